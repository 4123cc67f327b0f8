"""Inputs found by fuzzing the server, checked at the engine: they must not break a step."""

from __future__ import annotations

from pathlib import Path

from lora_guard import LLM, SamplingParams


def test_a_vanishing_temperature_is_greedy_not_a_crash(tiny_model: Path) -> None:
    llm = LLM(tiny_model, kv_cache_memory="4MiB", policies="lru")
    greedy = llm.generate("0", SamplingParams(max_new_tokens=8, ignore_eos=True))[0]
    tiny = SamplingParams(max_new_tokens=8, ignore_eos=True, temperature=1.4e-45, seed=3)
    out = llm.generate("0", tiny)[0]
    assert out.error is None and out.token_ids == greedy.token_ids
    llm.engine.check_no_leaks()
