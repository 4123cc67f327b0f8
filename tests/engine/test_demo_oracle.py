"""The oracle on the demo model (SmolLM2-135M-Instruct) with its real adapters."""

from __future__ import annotations

import pytest

from lora_guard import LLM, SamplingParams
from lora_guard.demo.paths import DemoPaths
from lora_guard.demo.testing import reference_greedy

NEW_TOKENS = 12


@pytest.mark.slow
def test_demo_mixed_batch_matches_transformers_and_peft(demo: DemoPaths) -> None:
    names = ["demo-00", "demo-05", "demo-06", "demo-11", "demo-23"]  # ranks 8 to 64, rsLoRA, MLP
    llm = LLM(
        demo.model_dir,
        adapter_dir=demo.adapter_dir,
        kv_cache_memory="256MiB",
        max_loras=3,
        dtype="float32",
        device="cpu",
    )
    tok = llm.tokenizer
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    shared = list(tok.apply_chat_template(chat, add_generation_prompt=True))
    text = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert llm.engine.encode(text) == shared, "a templated prompt must not get a second BOS"
    other = tok.encode("Write one sentence about the sea.")
    adapters: list[str | None] = [None, *names]
    requests = [(shared, a) for a in adapters] + [(other, a) for a in adapters[::2]]

    outs = llm.generate(
        [p for p, _ in requests],
        SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True),
        [a for _, a in requests],
    )
    expected = reference_greedy(
        demo.model_dir,
        [(p, None if a is None else demo.adapter_dir / a) for p, a in requests],
        NEW_TOKENS,
    )
    for (_, adapter), out, ref in zip(requests, outs, expected, strict=True):
        assert out.token_ids == ref, f"adapter {adapter}"
    assert "Paris" in outs[0].text
    llm.engine.check_no_leaks()
