"""The schemes a virtual-time study compares, each on the same model, adapters and costs
(``Bench``): the rival policies, the seated designs users run (``SEATED``), the references;
and the capacity the load is a share of."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from lora_guard.bench.capacity import CAPACITY_BATCH, Capacity, capacity_prompts
from lora_guard.bench.replay import BindRecorder
from lora_guard.bench.virtual.replay import Replay, Result, VirtualClock, warm_up
from lora_guard.cost_profiles import Profile
from lora_guard.simulate_costs import MIB, Costs
from lora_guard.workload.trace import (
    TraceRequest,
    WorkloadSpec,
)

#: scheme -> ``--policies`` (None: the defaults, lora-guard's guard policies)
# one row a line, as a table reads (fmt: skip)
SCHEMES: dict[str, str | None] = {
    "base": "lru", "lru": "lru", "fifo": "fifo", "drain": "drain", "time-slice": "time-slice",
    "s3-fifo": "s3-fifo", "w-tinylfu": "w-tinylfu", "as-vllm": "lru", "as-sglang": "drain",
    "lora-guard": None, "all-resident": "lru", "static": "static", "on-demand": "on-demand",
    "clairvoyant": "lru",
}  # fmt: skip

#: The designs users run, on the same engine and pool: adapter seats with memory of their own
#: beside the KV (``adapter_memory``: seats x the largest adapter, vLLM's ``--max-loras`` x
#: ``--max-lora-rank``, SGLang's adapter pool), first come first served with a skip for requests
#: whose adapter cannot be seated; vLLM's LRU, SGLang's LRU with its drainer. Each is run at
#: every seat count of ``SEATS`` the pool can hold, and reported at its best (an operator's
#: tuning); the sweep is in the JSON.
SEATED = ("as-vllm", "as-sglang")

SEATS = (1, 2, 4, 8, 16)

#: eviction that knows the whole trace, on the same pool (``virtual/clairvoyant.py``): a
#: reference for what an eviction order could gain, not a rival
CLAIRVOYANT = "clairvoyant"

#: every adapter the trace names pinned in pages added to the pool, so the KV keeps its room: the
#: latency no residency policy can beat on that pool (loads and adapter waits cost nothing)
ALL_RESIDENT = "all-resident"


@dataclass
class Bench:
    """What every replay of a study shares: the model, its adapters, their sizes, the costs.
    Bytes are this model's; ``scale`` turns them into the profile model's."""

    model: Path
    adapter_dir: Path
    adapter_ids: list[str]
    profile: Profile
    costs: Costs  # the profile's, or a calibration's (--costs)
    max_loras: int = 0
    scale: float = 1.0
    adapter_bytes: dict[str, int] = field(default_factory=dict)  # files, on this model
    settings: dict[str, Any] = field(default_factory=dict)  # policy settings for every scheme

    def profile_mib(self) -> dict[str, float]:
        return {a: b * self.scale / MIB for a, b in self.adapter_bytes.items()}

    def llm(
        self,
        clock: VirtualClock,
        policies: str | None,
        cache_memory: int,
        max_loras: int,
        pin: Sequence[str] = (),
        adapter_memory: int | None = None,
        host_adapters: int | None = None,
        static_adapter: str | None = None,
    ) -> Any:
        from lora_guard.engine import LLM

        settings: dict[str, Any] = {**self.settings, "pin": list(pin)}
        if static_adapter is not None:
            settings["static_adapter"] = static_adapter
        return LLM(
            self.model,
            adapter_dir=self.adapter_dir,
            max_cpu_loras=len(self.adapter_ids) if host_adapters is None else host_adapters,
            cache_memory=cache_memory,
            adapter_memory=adapter_memory,
            max_loras=max_loras,
            max_lora_rank=64,
            policies=policies,
            settings=settings,
            clock=clock,
        )

    def pages_bytes(self, adapter_ids: Sequence[str], largest: bool = False) -> int:
        """Bytes of the pool pages ``adapter_ids`` take together (``largest``: the largest's)."""
        clock = VirtualClock()
        llm = self.llm(clock, "lru", 64 * MIB, 0)
        replay = self.replay(llm, clock)
        warm_up(replay, adapter_ids)
        engine = llm.engine
        pages = engine.adapter_pages(list(adapter_ids)).values()
        page_bytes = engine.memory().page_bytes
        engine.shutdown()
        return int((max(pages) if largest else sum(pages)) * page_bytes)

    def replay(self, llm: Any, clock: VirtualClock) -> Replay:
        return Replay(llm, clock, self.costs, self.profile_mib(), self.scale)


def capacity(bench: Bench, spec: WorkloadSpec) -> Capacity:
    """The bench's capacity run (``CAPACITY_BATCH`` requests at once, base model), virtually."""
    trace = [
        TraceRequest(f"cap-{i}", 0.0, "t0", None, prompt, n)
        for i, (prompt, n) in enumerate(capacity_prompts(spec, bench.adapter_ids))
    ]
    clock = VirtualClock()
    llm = bench.llm(clock, "lru", 64 * MIB, 0)
    replay = bench.replay(llm, clock)
    started = clock.now
    records, _ = replay.run(trace, adapters=False)
    elapsed = clock.now - started
    llm.engine.shutdown()
    tokens = sum(len(r.tokens) for r in records)
    return Capacity(len(records) / elapsed, tokens / elapsed, CAPACITY_BATCH, tokens / len(records))


def run_seated(
    bench: Bench, scheme: str, trace: Sequence[TraceRequest], cache_memory: int
) -> Result:
    """``scheme`` (of :data:`SEATED`) at each seat count whose adapter memory leaves the KV at
    least half the pool; the best by TTFT p95, with the sweep."""
    asked = sorted({r.adapter_id for r in trace if r.adapter_id})
    largest = bench.pages_bytes(asked, largest=True)
    tried: dict[int, Result] = {}
    for seats in SEATS:
        if seats * largest > cache_memory // 2:
            break
        tried[seats] = run_scheme(bench, scheme, trace, cache_memory, (seats, seats * largest))[0]
    if not tried:
        raise ValueError(f"{scheme}: the pool cannot hold one seat of the largest adapter")
    p95 = {n: r.figures()["ttft_p95_ms"] or float("inf") for n, r in tried.items()}
    best = min(p95, key=p95.__getitem__)
    result = tried[best]
    result.seats = {
        n: {"ttft_p95_ms": p95[n], "seats_mib": n * largest * bench.scale / MIB} for n in tried
    }
    result.best_seats = best
    return result


def run_scheme(
    bench: Bench,
    scheme: str,
    trace: Sequence[TraceRequest],
    cache_memory: int,
    seated: tuple[int, int] | None = None,
) -> tuple[Result, int]:
    """``scheme`` replaying ``trace``; its result, and the most KV blocks' bytes it held.
    ``seated``: seats and the bytes kept for them (:data:`SEATED`)."""
    asked = sorted({r.adapter_id for r in trace if r.adapter_id})
    pin: Sequence[str] = ()
    if scheme == ALL_RESIDENT:
        pin, cache_memory = asked, cache_memory + bench.pages_bytes(asked)
    static = asked[0] if scheme == "static" and asked else None
    if static is not None:
        # one adapter merged for good: one instance of the many a static design runs, serving
        # the whole load for its adapter
        trace = [replace(r, adapter_id=static if r.adapter_id else None) for r in trace]
        asked = [static]
    clock = VirtualClock()
    max_loras = 0 if scheme in ("base", ALL_RESIDENT) else bench.max_loras
    adapter_memory = None
    if seated is not None:
        max_loras, adapter_memory = seated
    # on-demand keeps no host pool (the least the engine allows): a switch reads from disk
    host = max(1, max_loras) if scheme == "on-demand" else None
    llm = bench.llm(
        clock, SCHEMES[scheme], cache_memory, max_loras, pin, adapter_memory, host, static
    )
    replay = bench.replay(llm, clock)
    adapters = scheme != "base"
    if adapters:
        warm_up(replay, asked)
    engine = llm.engine
    before = engine.figures()
    recorder = BindRecorder(clock.now, clock)
    engine.hooks.pm.register(recorder, name="virtual-time-binds")
    replay.peak_kv_blocks = replay.peak_used_pages = 0
    replay.read_ms.clear()
    replay.write_ms.clear()
    replay.room_waits.clear()
    replay.parked_steps = 0
    preempted = engine.stats.preemptions
    if scheme == CLAIRVOYANT:
        from lora_guard.bench.virtual.clairvoyant import ClairvoyantEviction

        knows = ClairvoyantEviction(engine, trace, llm.tokenizer.encode, clock.now)
        engine.hooks.pm.register(knows, name="virtual-time-clairvoyant")
    records, rejected = replay.run(trace, adapters)
    engine.check_no_leaks()
    tenants = {r.id: r.tenant for r in trace}
    loads = engine.figures().loads - before.loads
    result = Result(
        scheme,
        records,
        tenants,
        loads,
        recorder.ordered_binds(),
        before.resident,
        rejected,
        replay.arrivals,
    )
    page_bytes = engine.memory().page_bytes
    switches = sum(replay.read_ms) + sum(replay.write_ms)
    result.switch_ms = switches / loads if loads else None
    result.peak_used_bytes = int(replay.peak_used_pages * page_bytes * bench.scale)
    result.room_waits = list(replay.room_waits)
    result.parked_steps = replay.parked_steps
    result.preemptions = engine.stats.preemptions - preempted
    kv_bytes = replay.peak_kv_blocks * page_bytes
    engine.shutdown()
    return result, kv_bytes
