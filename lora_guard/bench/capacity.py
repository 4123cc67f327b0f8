"""The machine's capacity for a workload, and the arrival rate that loads it to a given share.

Capacity is the base model's throughput on this machine, in requests a second, for requests drawn
like the trace's (same prompt and output lengths), ``CAPACITY_BATCH`` of them at once: what one
instance can serve with no adapter at all. ``--load 0.7`` makes the trace arrive at 0.7 of it on
average, so every scheme is compared at the same utilisation whatever the machine.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from lora_guard.bench.replay import EngineOptions
from lora_guard.clock import timer
from lora_guard.workload.scenarios import scenario
from lora_guard.workload.trace import WorkloadSpec, make_trace

CAPACITY_BATCH = 16  # requests run at once to measure the capacity


@dataclass(frozen=True)
class Capacity:
    requests_per_s: float
    tokens_per_s: float  # generated tokens
    batch: int
    mean_new_tokens: float


def capacity_prompts(spec: WorkloadSpec, adapter_ids: list[str]) -> list[tuple[str, int]]:
    """``CAPACITY_BATCH`` (prompt, max_new_tokens) pairs drawn as the trace draws them (the
    first of a scenario with a generator of its own, such as ``public``: its lengths are its own;
    a drawn scenario's as ``zipf``'s, the draw before its events)."""
    own = scenario(spec.scenario).generate is not None
    sample = make_trace(
        replace(spec, requests=CAPACITY_BATCH, scenario=spec.scenario if own else "zipf"),
        adapter_ids,
    )
    return [(r.prompt, r.max_new_tokens) for r in sample]


def measure_capacity(prompts: list[tuple[str, int]], options: EngineOptions) -> Capacity:
    """Run ``prompts`` at once on the base model (after a warm-up) and time them."""
    from lora_guard.engine import LLM, SamplingParams

    llm = LLM(
        options.model,
        policies="lru",
        kv_cache_memory=options.kv_cache_memory,
        max_num_seqs=options.max_num_seqs,
        dtype=options.dtype,
        device=options.device,
    )
    llm.generate(prompts[0][0], SamplingParams(max_new_tokens=4, ignore_eos=True))
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for _, n in prompts]
    started = timer()
    outputs = llm.generate([p for p, _ in prompts], params)
    elapsed = timer() - started
    llm.engine.shutdown()
    failed = [out.error for out in outputs if out.error is not None]
    if failed:
        raise RuntimeError(f"the capacity run failed: {failed[0]}")
    tokens = sum(len(out.token_ids) for out in outputs)
    return Capacity(len(prompts) / elapsed, tokens / elapsed, len(prompts), tokens / len(prompts))


def mean_rate_factor(spec: WorkloadSpec) -> float:
    """The trace's mean arrival rate over its rate outside bursts."""
    burst_share = spec.burst_len_s / spec.burst_every_s
    return 1 + (spec.burst_factor - 1) * burst_share


def arrival_rate(spec: WorkloadSpec, load: float, capacity: Capacity) -> float:
    """The rate outside bursts at which arrivals average ``load`` x ``capacity``."""
    return load * capacity.requests_per_s / mean_rate_factor(spec)
