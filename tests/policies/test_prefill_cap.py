"""Hot-set's prefill cap, on the engine with a real model: a burst of prompts starts over a few
steps, first come first, where without it every prompt of the burst gets its first token in one
long step, the last."""

from __future__ import annotations

from pathlib import Path

from lora_guard import LLM, SamplingParams
from lora_guard.policies.hot_set import PREFILL_TOKENS

PROMPT_TOKENS = 200


def first_token_steps(tiny_model: Path, settings: dict[str, int]) -> dict[str, int]:
    """Six prompts of 200 tokens arriving at once: the step at which each gets its first token."""
    llm = LLM(tiny_model, cache_memory="32MiB", settings=settings)  # the default policies
    engine = llm.engine
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    for i in range(6):  # each begins with its own token: no prefix shared
        engine.add_request(f"r{i}", [10 + i, *range(20, 20 + PROMPT_TOKENS - 1)], params)
    first: dict[str, int] = {}
    step = 0
    while engine.has_unfinished_requests():
        step += 1
        for out in engine.step():
            assert out.error is None, out.error
            if out.token_ids:
                first.setdefault(out.request_id, step)
    engine.check_no_leaks()
    return first


def test_a_burst_of_prompts_starts_over_a_few_steps_first_come_first(tiny_model: Path) -> None:
    capped = first_token_steps(tiny_model, {})
    per_step = max(1, PREFILL_TOKENS // PROMPT_TOKENS)  # two 200-token prompts in 512 tokens
    order = [capped[f"r{i}"] for i in range(6)]
    assert order == sorted(order)  # first come, first token
    assert order[0] == 1 and order[-1] > order[0]  # the first one need not wait for the last
    assert max(order.count(s) for s in set(order)) == per_step
    uncapped = first_token_steps(tiny_model, {"prefill_tokens_per_step": 0})
    assert set(uncapped.values()) == {1}  # every prompt in one step, each first token last
