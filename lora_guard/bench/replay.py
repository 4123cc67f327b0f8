"""Replay a trace on the engine in this process, for one scheme, in real time.

Requests are added when their trace time comes. A request a policy turns away with a retry-after
is sent again once that time has passed, as a client would after a 429; every request ends in
tokens or an error, and the record says how many retries it took.
"""

from __future__ import annotations

import resource
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from lora_guard.bench.load import RequestRecord
from lora_guard.bench.replay_loop import replay_loop
from lora_guard.clock import monotonic
from lora_guard.engine import LLM, SamplingParams
from lora_guard.engine.llm_engine import LLMEngine
from lora_guard.engine.lora.registry import scan_adapter_dir
from lora_guard.engine.outputs import RequestOutput, StepRecord
from lora_guard.plugins import hookimpl
from lora_guard.plugins.state import RequestView
from lora_guard.workload.trace import TraceRequest

_IDLE_WAIT_S = 0.001


@dataclass(frozen=True)
class Bind:
    """One moment a request needed its adapter in the pool (see ``bench/hit_rate``)."""

    time: float  # seconds from the start of the replay, when the need began
    adapter_id: str
    hit: bool  # the adapter was resident when the need began
    wait_ms: float | None  # until the adapter was usable (None where the engine does not say)


@dataclass
class SchemeRun:
    """One scheme's replay: per-request records and what the engine counted."""

    scheme: str
    records: list[RequestRecord]
    swap_ms: list[float]
    lookups: list[tuple[float, bool]]  # (time, hit in a device slot) per adapter lookup
    slots: int
    kv_conflicts: int
    cold_loads: dict[str, int]  # loaded, rejected, failed
    memory: dict[str, int]  # bytes, the engine's own accounting
    peak_rss: int | None  # bytes, of the process that ran the scheme alone
    duration_s: float
    served: list[str | None]  # adapter of each request as served, in arrival order
    binds: list[Bind] = field(default_factory=list)  # in the order the needs began
    steps: list[StepRecord] = field(default_factory=list)  # the engine's, during the replay
    start_resident: tuple[str, ...] = ()  # adapters in the pool when the replay began
    peer: dict[str, Any] | None = None  # a peer's command line, environment and log
    evictions: int | None = None  # adapters it evicted (None: a peer, which does not say)


@dataclass(frozen=True)
class EngineOptions:
    model: str
    adapter_dir: str
    max_loras: int = 0  # no seat cap
    max_lora_rank: int = 64
    kv_cache_memory: int | str = "768MiB"  # bytes, or a size such as 768MiB
    max_num_seqs: int = 64
    cold_loads_per_minute: int = 24
    dtype: str = "float32"
    lora_dtype: str = "auto"  # the adapters' pages: auto is dtype
    device: str = "cpu"
    request_log: str | None = None  # lora-guard's server: where it logs each request's times

    def llm(self, **knobs: Any) -> LLM:
        """An engine on this model, these adapters, this KV pool and these dtypes, with ``knobs``
        besides."""
        return LLM(
            self.model,
            adapter_dir=self.adapter_dir,
            max_lora_rank=self.max_lora_rank,
            kv_cache_memory=self.kv_cache_memory,
            max_num_seqs=self.max_num_seqs,
            dtype=self.dtype,
            lora_dtype=self.lora_dtype,
            device=self.device,
            **knobs,
        )


def scheme_llm(scheme: str, options: EngineOptions, static_adapter: str | None) -> LLM:
    """The engine a scheme stands for, with the same model, adapters and KV pool for all."""
    guard = {"cold_loads_per_minute": options.cold_loads_per_minute}
    if scheme == "static":
        return options.llm(policies="static", settings={"static_adapter": static_adapter})
    if scheme == "on-demand":
        # The naive scheme: one adapter merged at a time, read from disk at each switch.
        return options.llm(policies="on-demand", max_loras=1, max_cpu_loras=1)
    if scheme == "lru":
        return options.llm(policies="lru", max_loras=options.max_loras)
    if scheme == "lora-guard":
        return options.llm(max_loras=options.max_loras, settings=guard)
    if scheme == "lora-guard-observe":
        observe = {**guard, "kv_namespace_mode": "observe"}
        return options.llm(max_loras=options.max_loras, settings=observe)
    raise ValueError(f"unknown engine scheme {scheme!r}")


class BindRecorder:
    """Observes adapter lookups (one per request, hot or not) and binds (each time a request's
    adapter became usable, with how long it waited), with their times on ``clock`` (the
    engine's) since ``start``."""

    def __init__(self, start: float, clock: Callable[[], float] = monotonic) -> None:
        self.start, self.clock = start, clock
        self.lookups: list[tuple[float, bool]] = []
        self.binds: list[Bind] = []

    @hookimpl
    def lora_guard_adapter_lookup(self, request: RequestView, result: str) -> None:
        now = self.clock() - self.start
        self.lookups.append((now, result == "hot"))

    @hookimpl
    def lora_guard_adapter_ready(self, request: RequestView, wait_ms: float) -> None:
        if request.adapter_id is not None:
            began = self.clock() - self.start - wait_ms / 1000
            self.binds.append(Bind(began, request.adapter_id, wait_ms == 0.0, wait_ms))

    def ordered_binds(self) -> list[Bind]:
        return sorted(self.binds, key=lambda b: b.time)


def replay_scheme(
    scheme: str,
    trace: list[TraceRequest],
    options: EngineOptions,
    static_adapter: str | None = None,
) -> SchemeRun:
    """Build the scheme's engine and replay ``trace`` on it in real time."""
    llm = scheme_llm(scheme, options, static_adapter)
    engine = llm.engine
    if scheme == "static":
        trace = [_served_by(r, static_adapter) for r in trace]
    _warm_up(llm, trace)
    before = engine.figures()
    cold_before = _cold_load_counts(engine)
    steps_before = engine.stats.steps
    start = monotonic()
    recorder = BindRecorder(start)
    engine.hooks.pm.register(recorder, name="bench-lookups")
    memory = MemoryWatch(engine)
    steps: list[StepRecord] = []
    attempts = replay_loop(engine, trace, _WallClock(engine, start, memory, steps))
    records = list(attempts.records.values())
    duration = monotonic() - start
    engine.check_no_leaks()
    cold_after, after = _cold_load_counts(engine), engine.figures()
    run = SchemeRun(
        scheme=scheme,
        records=records,
        swap_ms=list(after.swap_ms[len(before.swap_ms) :]),
        evictions=after.evictions - before.evictions,
        lookups=recorder.lookups,
        # with no seat cap, the most adapters it ever held at once bounds its hits just as well
        slots=1 if after.merged_mode else engine.config.max_loras or after.peak_resident,
        kv_conflicts=after.kv_conflicts - before.kv_conflicts,
        cold_loads={k: cold_after[k] - cold_before[k] for k in cold_after},
        memory=memory.peak(),
        peak_rss=peak_rss_now(),
        duration_s=duration,
        served=[r.adapter_id for r in trace],
        binds=recorder.ordered_binds(),
        start_resident=before.resident,
        steps=[s for s in steps if s.step > steps_before],
    )
    engine.shutdown()
    return run


class _WallClock:
    """The replay on the machine's clock: idle time slept, each step's record kept in ``steps``
    (the engine keeps only its recent ones), the engine's memory sampled after each."""

    def __init__(
        self, engine: LLMEngine, start: float, memory: MemoryWatch, steps: list[StepRecord]
    ) -> None:
        self.engine, self.start, self.memory, self.steps = engine, start, memory, steps

    def now(self) -> float:
        return monotonic() - self.start

    def idle(self, until: float) -> None:
        time.sleep(min(max(until - self.now(), 0.0), 0.05))

    def step(self) -> list[RequestOutput]:
        outputs = self.engine.step()
        self.memory.sample()
        recent = self.engine.stats.recent_steps
        if recent and (not self.steps or recent[-1].step > self.steps[-1].step):
            self.steps.append(recent[-1])
        if not outputs:
            time.sleep(_IDLE_WAIT_S)  # waiting for an adapter read, or for the next arrival
        return outputs


def _warm_up(llm: LLM, trace: list[TraceRequest]) -> None:
    """One short request per adapter of the trace, not measured: the scheme starts as a server
    that has been up a while, not with every adapter's first read from disk."""
    adapters = list(dict.fromkeys(r.adapter_id for r in trace))
    llm.generate(["Warm-up."] * len(adapters), SamplingParams(max_new_tokens=1), adapters)


def _served_by(request: TraceRequest, adapter: str | None) -> TraceRequest:
    return replace(request, adapter_id=adapter)


class MemoryWatch:
    """The engine's memory by its own accounting: weights, the cache pool (KV blocks and adapter
    pages share it), and the copies a merge keeps or makes (the largest seen)."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        memory = engine.memory()
        self.fixed = {"weights": memory.weights, "cache_pool": memory.cache_pool}
        self.merge_copies = 0
        self.merge_delta = memory.merge_transient
        self.sample()

    def sample(self) -> None:
        self.merge_copies = max(self.merge_copies, self.engine.memory().merge_copies)

    def peak(self) -> dict[str, int]:
        parts = {
            **self.fixed,
            "merge_copies": self.merge_copies,
            "merge_transient": self.merge_delta,
        }
        return {**parts, "total": sum(parts.values())}


def _cold_load_counts(engine: LLMEngine) -> dict[str, int]:
    from lora_guard.metrics import metrics_of

    plugin = metrics_of(engine.hooks.pm)
    if plugin is None:
        return {"loaded": 0, "rejected": 0, "failed": 0}
    counts = {}
    for outcome in ("loaded", "rejected", "failed"):
        value = plugin.registry.get_sample_value(
            "lora_guard_cold_loads_total", {"outcome": outcome}
        )
        counts[outcome] = int(value or 0)
    return counts


def peak_rss_now() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def adapter_ids(adapter_dir: str | Path) -> list[str]:
    """Adapter ids in a folder of adapters (the registry's scan), sorted."""
    return [adapter_id for adapter_id, _ in scan_adapter_dir(Path(adapter_dir))]
