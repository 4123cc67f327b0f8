"""One timed batch on the engine and through transformers + PEFT, and the machine's matmul
peak: what ``python -m lora_guard.bench.engine`` measures."""

from __future__ import annotations

import itertools
import statistics
from typing import Any

import torch

from lora_guard.clock import timer
from lora_guard.demo.greedy import greedy, left_pad
from lora_guard.engine import LLM, SamplingParams

_RUNS = itertools.count()


def matmul_peak_gflops(dtype: torch.dtype, device: torch.device, n: int = 2048) -> float:
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    best = float("inf")
    for _ in range(5):
        _sync(device)
        started = timer()
        a @ b
        _sync(device)
        best = min(best, timer() - started)
    return 2 * n**3 / best / 1e9


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def batch_prompts(tokenizer: Any, batch: int) -> list[list[int]]:
    # About 32 tokens each, different per request so no prefix is shared.
    return [
        tokenizer.encode(
            f"Request {i}: please write a short story about the number {i}, a ship, "
            f"a lighthouse keeper and the sea at night, in plain words."
        )
        for i in range(batch)
    ]


def engine_run(
    llm: LLM, prompts: list[list[int]], adapters: list[str | None], new_tokens: int
) -> tuple[float, float, float]:
    """Median decode step time (ms), generated tokens per second and the prefill's time (ms:
    the steps before every request decodes) for one batch."""
    engine = llm.engine
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    tag = next(_RUNS)  # request ids new to the engine on every run
    for i, (prompt, adapter) in enumerate(zip(prompts, adapters, strict=True)):
        engine.add_request(f"bench-{tag}-{i}", prompt, params, adapter)
    decode_steps: list[float] = []
    prefill = 0.0
    started = timer()
    while engine.has_unfinished_requests():
        step_started = timer()
        computed_before = sum(s.num_computed_tokens for s in engine.scheduler.running)
        engine.step()
        _sync(engine.config.torch_device)
        elapsed = timer() - step_started
        running = engine.scheduler.running
        if running and len(running) == len(prompts) and computed_before > 0:
            decode_steps.append(elapsed)
        elif not decode_steps:
            prefill += elapsed
    total = timer() - started
    if not decode_steps:
        raise SystemExit(
            f"no step decoded all {len(prompts)} requests at once: "
            f"raise --new-tokens (now {new_tokens})"
        )
    return statistics.median(decode_steps) * 1000, len(prompts) * new_tokens / total, prefill * 1000


def peft_run(
    model: Any, prompts: list[list[int]], adapters: list[str], new_tokens: int, pad_id: int
) -> tuple[float, float, float]:
    """Decode step time (ms), tokens/s and prefill time (ms) of transformers + PEFT ``generate``
    on the batch."""
    ids, mask = left_pad(prompts, pad_id)

    def generate(n: int) -> float:
        started = timer()
        greedy(model, ids, mask, n, pad_id, min_new_tokens=n, adapter_names=adapters)
        return timer() - started

    generate(2)  # warm-up: kernels made for these shapes on first use are not a step's cost
    first = generate(1)
    full = generate(new_tokens)
    decode_ms = (full - first) / (new_tokens - 1) * 1000
    return decode_ms, len(prompts) * new_tokens / full, first * 1000
