"""Text to token ids and the end-of-sequence ids, as the engine reads them."""

from __future__ import annotations

from typing import Any


def encode_text(tokenizer: Any, prompt: str) -> list[int]:
    """Token ids of a text prompt as the engine reads it: a chat-templated prompt already starts
    with the BOS text, so no second one is added."""
    bos = tokenizer.bos_token
    templated = bool(bos) and prompt.startswith(bos)
    return list(tokenizer.encode(prompt, add_special_tokens=not templated))


def eos_token_ids(config: object, tokenizer: object) -> set[int]:
    ids: set[int] = set()
    for source in (getattr(config, "eos_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        if isinstance(source, int):
            ids.add(source)
        elif isinstance(source, list | tuple):
            ids.update(int(x) for x in source)
    return ids
