"""``/tokenize`` with TGI's body or vLLM's, told apart by their fields, and vLLM's
``/detokenize``.

TGI: ``{"inputs"}`` -> ``[{"id", "text", "start", "stop"}]``. vLLM: ``{"prompt"}`` (special tokens
added as the engine adds them to a prompt) or ``{"messages"}`` (through the chat template) ->
``{"count", "max_model_len", "tokens", "token_strs"}``; ``{"tokens"}`` -> ``{"prompt"}``.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from lora_guard.engine.tokens import encode_text
from lora_guard.naming import adapter_of
from lora_guard.server.errors import not_found, validation
from lora_guard.server.protocol import (
    ChatTokenizeRequest,
    DetokenizeRequest,
    PromptTokenizeRequest,
    TokenizeRequest,
)
from lora_guard.server.routes_openai import chat_text
from lora_guard.server.state import ServerState, state_of

router = APIRouter()


@router.post("/tokenize", response_model=None)
async def tokenize(
    body: TokenizeRequest | PromptTokenizeRequest | ChatTokenizeRequest, request: Request
) -> list[dict[str, Any]] | dict[str, Any]:
    state = state_of(request)
    if isinstance(body, TokenizeRequest):
        encoding = state.tokenizer(
            body.inputs, return_offsets_mapping=True, add_special_tokens=False
        )
        return [
            {"id": i, "text": body.inputs[a:b], "start": a, "stop": b}
            for i, (a, b) in zip(encoding["input_ids"], encoding["offset_mapping"], strict=True)
        ]
    _check_model(state, body.model)
    tokenizer = state.tokenizer
    if isinstance(body, PromptTokenizeRequest):
        # with special tokens: the ids the engine computes on for this prompt
        text = body.prompt
        ids = encode_text(tokenizer, text) if body.add_special_tokens else _encode(state, text)
    else:
        # the ids a chat completion computes on (the template brings its own BOS text), unless
        # special tokens are asked for on top
        text = chat_text(state, body.messages, body.add_generation_prompt)
        ids = (
            _encode(state, text, True) if body.add_special_tokens else encode_text(tokenizer, text)
        )
    strs = tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
    return {
        "count": len(ids),
        "max_model_len": state.limits.max_total_tokens,
        "tokens": ids,
        "token_strs": strs,
    }


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request) -> dict[str, str]:
    state = state_of(request)
    _check_model(state, body.model)
    vocab = len(state.tokenizer)
    bad = [t for t in body.tokens if not 0 <= t < vocab]
    if bad:
        raise validation(f"`tokens` must be ids below the vocabulary size {vocab}. Given: {bad[0]}")
    return {"prompt": str(state.tokenizer.decode(body.tokens))}


def _encode(state: ServerState, text: str, special: bool = False) -> list[int]:
    return list(state.tokenizer.encode(text, add_special_tokens=special))


def _check_model(state: ServerState, model: str | None) -> None:
    """vLLM's bodies may name the model: the base, or an adapter the server has."""
    adapter = adapter_of(model, state.model_id)
    if adapter is None or state.llm.knows_adapter(adapter):
        return
    raise not_found(f"The model `{model}` does not exist.")
