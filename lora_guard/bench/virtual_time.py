"""``python -m lora_guard.bench.virtual_time``: the bench's workload through the real engine and
its policies, on a clock that each step's modelled cost moves.

A wall-clock replay on a shared machine measures the machine as much as the policies. Here the real
engine (scheduler, residency, cache pool, policies, a tiny model's forward) runs every step as fast
as it can, and the engine's clock (the ``clock`` it is given, which every policy, the heat and
load windows and the residency quantum read) advances by what that step would cost under a cost
profile (``--profile``, ``cost_profiles``: a fixed part, a part per sequence, per MiB of adapter
weights the batch reads and per prompt token, plus each adapter written into the pool, per MiB).
A read from disk runs beside the steps, one at a time as the loader thread reads, and lands once
its modelled time (fixed + per MiB) has passed on the clock. The tiny model has the profile
model's proportions, scaled down, so an adapter's pages and a token's KV keep the real model's
ratio; bytes are counted as the same adapter (rank, targets) or KV takes on the profile's model.
A request a policy turns away (429) is sent again after its retry-after, as a client would.
Arrivals are replayed on that clock, at ``--load`` of the capacity measured the same way (the
bench's capacity run, on the base model). The same command gives the same figures on any machine,
busy or not; what it cannot show is a real cost the model leaves out.

    python -m lora_guard.bench.virtual_time --scenario pressure --profile a10-7b --seeds 0,1,2
"""

from __future__ import annotations

import argparse
import heapq
import json
import statistics
import tempfile
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

from lora_guard.bench.capacity import CAPACITY_BATCH, Capacity, arrival_rate, capacity_prompts
from lora_guard.bench.replay import Bind, BindRecorder, RequestRecord
from lora_guard.bench.report import decode_tokens_per_s, request_tokens_per_s, tail_ttft_shares
from lora_guard.config import add_engine_flags
from lora_guard.cost_profiles import PROFILES, Profile, profile, profiles_help
from lora_guard.plugins import hookimpl
from lora_guard.simulate_costs import MIB, Costs, read_costs
from lora_guard.workload.bounds import compulsory_hit_bound
from lora_guard.workload.scenarios import scenario
from lora_guard.workload.spec import PROMPT_WORDS
from lora_guard.workload.stats import percentile
from lora_guard.workload.trace import (
    SCENARIOS,
    TraceError,
    TraceRequest,
    WorkloadSpec,
    make_trace,
    read_trace,
)

#: scheme -> ``--policies`` (None: the defaults, lora-guard's guard policies)
# one row a line, as a table reads (fmt: skip)
SCHEMES: dict[str, str | None] = {
    "base": "lru", "lru": "lru", "fifo": "fifo", "drain": "drain", "time-slice": "time-slice",
    "s3-fifo": "s3-fifo", "w-tinylfu": "w-tinylfu", "as-vllm": "lru", "as-sglang": "drain",
    "lora-guard": None, "all-resident": "lru", "static": "static", "on-demand": "on-demand",
}  # fmt: skip
#: The designs users run, on the same engine and pool: adapter seats with memory of their own
#: beside the KV (``adapter_memory``: seats x the largest adapter, vLLM's ``--max-loras`` x
#: ``--max-lora-rank``, SGLang's adapter pool), first come first served with a skip for requests
#: whose adapter cannot be seated; vLLM's LRU, SGLang's LRU with its drainer. Each is run at
#: every seat count of ``SEATS`` the pool can hold, and reported at its best (an operator's
#: tuning); the sweep is in the JSON.
SEATED = ("as-vllm", "as-sglang")
SEATS = (1, 2, 4, 8, 16)
#: every adapter the trace names pinned in pages added to the pool, so the KV keeps its room: the
#: latency no residency policy can beat on that pool (loads and adapter waits cost nothing)
ALL_RESIDENT = "all-resident"
#: the seed's table (2 A10s, 24 adapters, 180 output tokens on average): peak memory over the
#: device's, adapter_swap_ms, P95 tokens/s, and the typical problem it names
SEED_SCHEMES = ("static", "on-demand", "lru", "lora-guard")
SEED_FIGURES: dict[str, dict[str, Any]] = {
    scheme: {"peak_memory": peak, "switch_ms": ms, "p95_tokens_per_s": speed, "problem": problem}
    for scheme, peak, ms, speed, problem in (
        ("static", 0.78, 8, 44, "inflexible, many instances"),
        ("on-demand", 0.92, 180, 31, "jitter, cold requests queue"),
        ("lru", 0.84, 46, 40, "cost and stability balanced"),
    )
}
IDLE_S = 100.0  # virtual seconds between the warm-up and the replay: the warm-up's heat is gone
PRESSURE_RANKS = (8, 16, 32, 64)  # with targets alternating: 21x in bytes from least to most
PRESSURE_FACTOR = 3.0  # adapters in use over a minute / the room beside the KV the load needs
WINDOW_S = 60.0


class VirtualClock:
    """The engine's clock in a replay: it moves only when the replay moves it."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Result:
    scheme: str
    records: list[RequestRecord]
    tenants: dict[str, str]  # request id -> tenant
    loads: int
    binds: list[Bind] = field(default_factory=list)
    start_resident: tuple[str, ...] = ()
    rejected: int = 0
    arrivals: list[tuple[str, bool]] = field(default_factory=list)  # adapter, resident then
    seats: dict[int, dict[str, float]] | None = None  # a seated scheme's sweep, by seat count
    best_seats: int | None = None
    switch_ms: float | None = None  # modelled reads and writes per adapter loaded
    peak_used_bytes: int = 0  # the pool's peak of KV in use and adapter pages, profile bytes
    # at each step some request waited for room for its adapter: the pool's share held by the
    # adapters running requests use, and by KV in use
    room_waits: list[tuple[float, float]] = field(default_factory=list)

    def figures(self) -> dict[str, Any]:
        done = [r for r in self.records if r.error is None and r.first_token is not None]
        ttft = [(r.first_token - r.arrival) * 1000 for r in done if r.first_token is not None]
        speeds = [s for r in done if (s := request_tokens_per_s(r)) is not None]
        decode = [s for r in done if (s := decode_tokens_per_s(r)) is not None]
        waits = [b.wait_ms for b in self.binds if b.wait_ms is not None]
        asked = [a for a, _ in self.arrivals]
        attempts = self.loads + self.rejected
        return {
            "scheme": self.scheme,
            "completed": len(done),
            "requests": len(self.records),
            "ttft_p50_ms": percentile(ttft, 50),
            "ttft_p95_ms": percentile(ttft, 95),
            "tail_tokens_per_s": percentile(speeds, 5),
            "decode_tail_tokens_per_s": percentile(decode, 5),
            "hit_rate": sum(hit for _, hit in self.arrivals) / len(asked) if asked else None,
            "hit_rate_bound": compulsory_hit_bound(asked, self.start_resident) if asked else None,
            "loads": self.loads,
            "adapter_wait_ms_p95": percentile(waits, 95),
            "held_ms_p95": percentile([r.held_s * 1000 for r in done], 95),
            **tail_ttft_shares(self.records),
            "room_wait_steps": len(self.room_waits),
            "room_wait_busy_adapter_share": percentile([b for b, _ in self.room_waits], 50),
            "room_wait_kv_share": percentile([k for _, k in self.room_waits], 50),
            "cold_fail_ratio": self.rejected / attempts if attempts else 0.0,
            "retries": sum(r.retries for r in self.records),
            "seats": self.best_seats,
            "switch_ms": self.switch_ms,
            "peak_pool_mib": self.peak_used_bytes / MIB,
        }

    def tenant_ttft_p95(self) -> dict[str, float | None]:
        by_tenant: dict[str, list[float]] = {}
        for r in self.records:
            if r.error is None and r.first_token is not None:
                ttft = (r.first_token - r.arrival) * 1000
                by_tenant.setdefault(self.tenants[r.id], []).append(ttft)
        return {t: percentile(v, 95) for t, v in sorted(by_tenant.items())}


class _Writes:
    """Observes the adapters written into the pool (MiB on the profile's model), for the step's
    cost."""

    def __init__(self, mib: dict[str, float], engine: Any) -> None:
        self.mib, self.engine = mib, engine
        self.written: list[tuple[int, float]] = []  # pages in this pool, MiB on the profile's

    @hookimpl
    def lora_guard_adapter_loaded(self, adapter_id: str) -> None:
        pages = self.engine.adapter_pages([adapter_id]).get(adapter_id, 0)
        self.written.append((pages, self.mib.get(adapter_id, 0.0)))


class Replay:
    """One engine driven step by step on the virtual clock."""

    def __init__(
        self,
        llm: Any,
        clock: VirtualClock,
        costs: Costs,
        adapter_mib: dict[str, float],
        scale: float,
    ) -> None:
        self.llm, self.engine, self.clock, self.costs = llm, llm.engine, clock, costs
        self.scale = scale  # bytes on the profile's model per byte on this one
        self.writes = _Writes(adapter_mib, self.engine)
        self.engine.hooks.pm.register(self.writes, name="virtual-time-writes")
        self.engine.costs.external = True
        from lora_guard.engine.lora.loader import ModelledReads

        self.reads = ModelledReads(clock, self._read_ms)
        self.engine.model_reads(self.reads)
        self.read_ms: list[float] = []  # each read from disk's modelled time
        self.write_ms: list[float] = []  # each adapter's write into the pool
        self.adapter_mib = adapter_mib
        self.engine.scheduler.reject_when_busy = True  # a server's 429, not an offline wait
        self.peak_kv_blocks = 0
        self.peak_used_pages = 0  # KV in use and adapter pages (cached free blocks not counted)
        self.arrivals: list[tuple[str, bool]] = []  # each request's adapter, and if resident
        self.room_waits: list[tuple[float, float]] = []  # see Result.room_waits

    def step(self) -> list[Any]:
        """One engine step; the clock moves by its cost (a read from disk lands by the next)."""
        stats = self.engine.stats
        steps = stats.steps
        self.writes.written.clear()
        outputs = self.engine.step()
        cost_ms = 1.0  # a step that computed nothing (the clock then goes to the next read)
        meter = self.engine.costs  # what the engine values pages by: the modelled costs
        if stats.steps > steps:
            ran = stats.recent_steps[-1]
            mib = ran.adapter_bytes * self.scale / MIB
            cost_ms = self.costs.step(ran.seqs, ran.adapters, ran.prefill_tokens, mib)
            meter.step(ran.prefill_tokens, cost_ms)
        for pages, mib in self.writes.written:
            write_ms = self.costs.write(mib)
            meter.write(pages, write_ms)
            self.write_ms.append(write_ms)
            cost_ms += write_ms
        self.clock.now += cost_ms / 1000
        due = self.reads.next_due()
        if stats.steps == steps and due is not None:
            self.clock.now = max(self.clock.now, due)  # nothing to run before a read lands
        self.peak_kv_blocks = max(self.peak_kv_blocks, self.engine.figures().kv_blocks_used)
        blocks = self.engine.scheduler.blocks
        used = (
            blocks.num_blocks
            - blocks.num_blank_pages
            - (blocks.num_kv_pages - blocks.num_used_blocks)
        )
        self.peak_used_pages = max(self.peak_used_pages, used)
        self._note_room_wait()
        self.engine.wait_for_reads()
        return list(outputs)

    def _note_room_wait(self) -> None:
        """When a request waits for its adapter, read from disk already but not let into the
        pool (no room), what holds the pool: adapters running requests use, and KV in use."""
        scheduler = self.engine.scheduler
        residency, blocks = scheduler.adapters, scheduler.blocks
        residents = residency.residents()
        resident = {e.adapter_id for e in residents if not e.stale}
        reading = set(residency.loader.pending)
        waiting = {
            s.adapter_id
            for s in (*scheduler.waiting, *scheduler.running)
            if s.adapter_id is not None and s.adapter_id not in resident | reading
        }
        if not waiting:
            return
        busy = {s.adapter_id for s in scheduler.running if s.parked_since is None}
        pages = sum(e.num_pages for e in residents if e.adapter_id in busy)
        total = blocks.num_blocks
        self.room_waits.append((pages / total, blocks.num_used_blocks / total))

    def _read_ms(self, adapter: str) -> float:
        ms = self.costs.read(self.adapter_mib.get(adapter, 0.0))
        self.read_ms.append(ms)
        return ms

    def run(self, trace: Sequence[TraceRequest], adapters: bool) -> tuple[list[RequestRecord], int]:
        """Replay ``trace``; the records, and how many answers were 429s (each sent again)."""
        from lora_guard.engine import SamplingParams

        start = self.clock.now
        by_id = {r.id: r for r in trace}
        due = [(r.time, i, r.id) for i, r in enumerate(trace)]
        heapq.heapify(due)
        records = {
            r.id: RequestRecord(r.id, r.adapter_id if adapters else None, r.time) for r in trace
        }
        attempt_of: dict[str, str] = {}
        rejected, tiebreak = 0, len(trace)
        while due or self.engine.has_unfinished_requests():
            if not self.engine.has_unfinished_requests() and self.clock.now - start < due[0][0]:
                self.clock.now = start + due[0][0]  # nothing to do until the next arrival
            while due and due[0][0] <= self.clock.now - start:
                _, _, trace_id = heapq.heappop(due)
                r, record = by_id[trace_id], records[trace_id]
                attempt = f"{trace_id}#{record.retries}"
                params = SamplingParams(max_new_tokens=r.max_new_tokens, ignore_eos=True)
                if record.adapter_id is not None and not record.retries:
                    hit = record.adapter_id in self.engine.figures().resident
                    self.arrivals.append((record.adapter_id, hit))
                self.engine.add_request(
                    attempt,
                    self.llm.tokenizer.encode(r.prompt),
                    params,
                    record.adapter_id,
                    r.tenant,
                )
                attempt_of[attempt] = trace_id
            for out in self.step():
                record, now = records[attempt_of[out.request_id]], self.clock.now - start
                if out.token_ids and record.first_token is None:
                    record.first_token = now
                if not out.finished:
                    continue
                del attempt_of[out.request_id]
                if out.error is not None and out.retry_after is not None:
                    rejected += 1
                    record.retries += 1
                    tiebreak += 1
                    heapq.heappush(due, (now + out.retry_after, tiebreak, record.id))
                    continue
                record.finish, record.tokens, record.error = now, list(out.token_ids), out.error
                record.held_s += out.held_s
                record.adapter_wait_s += out.adapter_wait_s
        return list(records.values()), rejected


def warm_up(replay: Replay, adapter_ids: Sequence[str]) -> None:
    """Every adapter read into host memory once, as the bench's warm-up does."""
    from lora_guard.engine import SamplingParams

    params = SamplingParams(max_new_tokens=1, ignore_eos=True)
    for i, adapter in enumerate(adapter_ids):
        replay.engine.add_request(f"warm-{i}", [5, 6, 7], params, adapter)
    while replay.engine.has_unfinished_requests():
        replay.step()
    replay.clock.now += IDLE_S


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

        settings: dict[str, Any] = {"pin": list(pin)}
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
    kv_bytes = replay.peak_kv_blocks * page_bytes
    engine.shutdown()
    return result, kv_bytes


def window_bytes(trace: Sequence[TraceRequest], sizes: dict[str, int]) -> list[int]:
    """Bytes of the distinct adapters each full ``WINDOW_S`` window of ``trace`` asks for (one
    window starting at each request); a trace shorter than a window is one window."""
    asked = [(r.time, r.adapter_id) for r in trace if r.adapter_id is not None]
    end = asked[-1][0] if asked else 0.0
    out = []
    for i, (start, _) in enumerate(asked):
        if start + WINDOW_S > end:
            break
        names = {a for t, a in asked[i:] if t < start + WINDOW_S}
        out.append(sum(sizes[a] for a in names))
    return out or [sum(sizes[a] for a in {a for _, a in asked})]


@dataclass
class Pressure:
    """How the pool of a ``pressure`` study is sized: the KV the load needs, and room for a
    third of the adapters in use over a minute. The KV is the most an LRU replay of the same
    trace held with every adapter fitting: with adapter-scoped keys each adapter's requests
    cache their prompts apart, so the adapters' load holds more KV than the base model's."""

    kv_bytes: int
    window_bytes_p10: int
    window_bytes_p50: int
    scale: float = 1.0  # bytes on the profile's model per byte here, for the summary

    @property
    def cache_memory(self) -> int:
        return self.kv_bytes + int(self.window_bytes_p10 / PRESSURE_FACTOR)

    def summary(self) -> dict[str, Any]:
        room = max(self.cache_memory - self.kv_bytes, 1)
        return {
            "kv_mib": self.kv_bytes * self.scale / MIB,
            "adapter_room_mib": room * self.scale / MIB,
            "cache_memory_mib": self.cache_memory * self.scale / MIB,
            "in_use_per_minute_over_room_p10": self.window_bytes_p10 / room,
            "in_use_per_minute_over_room_p50": self.window_bytes_p50 / room,
        }


@dataclass
class SeedRun:
    seed: int | None
    rate: float | None
    results: list[Result]
    pressure: Pressure | None = None
    calm: list[Result] = field(default_factory=list)  # tenant-storm: the trace without the storm


def study(
    bench: Bench,
    spec: WorkloadSpec,
    schemes: Sequence[str],
    load: float,
    trace: list[TraceRequest] | None = None,
    cache_memory: int | None = None,
) -> SeedRun:
    """Every scheme on one trace (``trace``, or one drawn from ``spec`` at ``load`` of the
    capacity). The pool is ``cache_memory`` (bytes of the profile's model), or for ``pressure``
    and ``public`` sized by :class:`Pressure`, else the profile's memory for KV and adapters."""
    rate = None
    if trace is None:
        rate = arrival_rate(spec, load, capacity(bench, spec))
        trace = make_trace(replace(spec, rate=rate), bench.adapter_ids)
    results: dict[str, Result] = {}
    pressure = None
    chosen = scenario(spec.scenario)
    if cache_memory is None and chosen.sized_pool:
        _, kv_bytes = run_scheme(bench, "lru", trace, 64 * MIB)
        windows = window_bytes(trace, bench.adapter_bytes)
        pressure = Pressure(
            kv_bytes,
            int(percentile(windows, 10) or 0),
            int(percentile(windows, 50) or 0),
            bench.scale,
        )
        pool = pressure.cache_memory
    else:
        pool = int((cache_memory or bench.profile.memory_bytes) / bench.scale)
    for scheme in schemes:
        if scheme not in results:
            results[scheme] = _run(bench, scheme, trace, pool)
    calm = []
    if chosen.calm is not None and rate is not None:
        quiet = make_trace(replace(spec, rate=rate, scenario=chosen.calm), bench.adapter_ids)
        calm = [_run(bench, s, quiet, pool) for s in schemes]
    return SeedRun(spec.seed, rate, [results[s] for s in schemes], pressure, calm)


def _run(bench: Bench, scheme: str, trace: Sequence[TraceRequest], pool: int) -> Result:
    if scheme in SEATED:
        return run_seated(bench, scheme, trace, pool)
    return run_scheme(bench, scheme, trace, pool)[0]


def report(runs: Sequence[SeedRun], schemes: Sequence[str]) -> dict[str, Any]:
    """Medians over the seeds of each scheme's figures (``completed`` and ``requests`` summed),
    each seed's figures under ``runs``, and each tenant's TTFT p95."""
    per_scheme: dict[str, list[dict[str, Any]]] = {s: [] for s in schemes}
    tenants: dict[str, dict[str, list[float]]] = {}
    for run in runs:
        for result in run.results:
            per_scheme[result.scheme].append(result.figures())
            for tenant, p95 in result.tenant_ttft_p95().items():
                if p95 is not None:
                    tenants.setdefault(tenant, {}).setdefault(result.scheme, []).append(p95)
    out: dict[str, Any] = {"schemes": {}, "tenants": {}, "runs": []}
    for scheme, rows in per_scheme.items():
        merged: dict[str, Any] = {}
        for key in rows[0]:
            values = [row[key] for row in rows]
            if key in ("completed", "requests", "retries"):
                merged[key] = sum(values)
            elif all(isinstance(v, int | float) for v in values):
                merged[key] = statistics.median(values)
            elif key != "scheme":
                merged[key] = None
        out["schemes"][scheme] = merged
    for tenant, by_scheme in sorted(tenants.items()):
        out["tenants"][tenant] = {
            s: {"ttft_p95_ms": statistics.median(v)} for s, v in by_scheme.items()
        }
    storm = [run for run in runs if run.calm]
    if storm:
        out["storm"] = {
            s: statistics.median(_storm_ratio(run, s) for run in storm) for s in schemes
        }
    for run in runs:
        out["runs"].append(
            {
                "seed": run.seed,
                "rate": run.rate,
                "pool": run.pressure.summary() if run.pressure else None,
                "schemes": {r.scheme: r.figures() for r in run.results},
                "seat_sweeps": {r.scheme: r.seats for r in run.results if r.seats},
            }
        )
    versus = lora_guard_ratios(out["runs"])
    if versus:
        out["lora_guard_over"] = versus
    return out


#: not rivals: the base model (no adapters), the reference that adds memory, one adapter merged
#: for good (it serves one adapter's load, not the trace), lora-guard itself
NOT_RIVALS = ("base", ALL_RESIDENT, "static", "lora-guard")


def lora_guard_ratios(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """lora-guard's TTFT p95 over the best rival's and each scheme's, and its tail tokens/s over
    the best rival's, per seed first, then their median and range (the same way for every
    figure)."""
    per_seed: dict[str, list[float]] = {}
    best_names = []
    for run in runs:
        rows = run["schemes"]
        ours = rows.get("lora-guard")
        rivals = {s: r for s, r in rows.items() if s not in NOT_RIVALS and r["ttft_p95_ms"]}
        if ours is None or not ours["ttft_p95_ms"] or not rivals:
            return {}
        best = min(rivals, key=lambda s: rivals[s]["ttft_p95_ms"])
        best_names.append(best)
        ratios = {"best rival ttft_p95": ours["ttft_p95_ms"] / rivals[best]["ttft_p95_ms"]}
        tails = [r["tail_tokens_per_s"] for r in rivals.values() if r["tail_tokens_per_s"]]
        if tails and ours["tail_tokens_per_s"]:
            ratios["best rival tail_tokens_per_s"] = ours["tail_tokens_per_s"] / max(tails)
        for scheme, row in rows.items():
            if scheme != "lora-guard" and row["ttft_p95_ms"]:
                ratios[f"{scheme} ttft_p95"] = ours["ttft_p95_ms"] / row["ttft_p95_ms"]
        for name, value in ratios.items():
            per_seed.setdefault(name, []).append(value)
    return {
        "best_rival_by_seed": best_names,
        **{
            name: {
                "per_seed": values,
                "median": statistics.median(values),
                "range": [min(values), max(values)],
            }
            for name, values in per_seed.items()
        },
    }


def _storm_ratio(run: SeedRun, scheme: str) -> float:
    """The other tenants' TTFT p95 with tenant t0's storm over the same without it."""

    def others_p95(results: list[Result]) -> float:
        result = next(r for r in results if r.scheme == scheme)
        ttft = [
            (r.first_token - r.arrival) * 1000
            for r in result.records
            if r.first_token is not None and result.tenants[r.id] != "t0"
        ]
        return percentile(ttft, 95) or 0.0

    calm = others_p95(run.calm)
    return others_p95(run.results) / calm if calm else float("inf")


def trace_ranks(path: Path) -> dict[str, int]:
    """Each adapter a JSONL trace names, with its rank: the line's ``rank`` field, else the
    ranks of :data:`PRESSURE_RANKS` in turn."""
    ranks: dict[str, int] = {}
    with path.open() as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            data = json.loads(line)
            adapter = data.get("adapter_id")
            if adapter is None:
                continue
            if not isinstance(adapter, str) or not adapter or Path(adapter).name != adapter:
                raise TraceError(f"{path}:{number}: adapter_id must be a plain name: {adapter!r}")
            rank = data.get("rank", PRESSURE_RANKS[len(ranks) % len(PRESSURE_RANKS)])
            if not isinstance(rank, int) or not 1 <= rank <= 64:
                raise TraceError(f"{path}:{number}: rank must be a whole number 1-64: {rank!r}")
            ranks.setdefault(adapter, rank)
    return ranks


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m lora_guard.bench.virtual_time",
        description="The bench workload through the real engine and policies on a virtual clock.",
    )
    add = parser.add_argument
    add(
        "--schemes",
        help=f"comma-separated, of {', '.join(SCHEMES)} (default: base,lru,lora-guard; seed: "
        f"{','.join(SEED_SCHEMES)})",
    )
    add(
        "--scenario",
        choices=SCENARIOS,
        default="zipf",
        help="; ".join(f"{s.name}: {s.about}" for s in SCENARIOS.values())
        + "; pressure and public run 1000 requests in a pool sized by the load (default: zipf)",
    )
    add(
        "--trace",
        type=Path,
        help="replay this JSONL trace (the bench's format; adapters it names "
        "are made for the tiny model, ranks from an optional 'rank' field)",
    )
    # The engine's flags as `lora-guard serve` has them. Without --cache-memory the pool is sized
    # here, by the scenario (not a quarter of free memory): the figures depend on no machine.
    add_engine_flags(
        parser,
        ["max_loras", "cache_memory"],
        shown={
            "cache_memory": "the profile's memory for KV and adapters, in its model's bytes; "
            "pressure and public: sized so the adapters in use over a minute take 3x the room "
            "beside the KV the load needs"
        },
    )
    add("--seeds", default=None, help="comma-separated trace seeds (default: 0)")
    add("--seed", type=int, help="one seed: --seeds N")
    add("--requests", type=int, help="requests per seed (default 200; pressure: 1000)")
    add("--adapters", type=int, help="adapters (default 24; pressure: 200)")
    add("--tenants", type=int, help="tenants (default 6; pressure: 8)")
    add("--load", type=float, default=0.7, help="share of the capacity")
    add("--output-mean", type=float, help="mean output tokens (default 64; seed: 180)")
    add(
        "--profile",
        choices=PROFILES,
        default="cpu-demo",
        help=f"the model's shape, memory and costs (docs/simulate.md): {profiles_help()}",
    )
    add("--costs", type=Path, help="costs JSON (simulate --calibrate), over the profile's")
    add("--json", type=Path, help="write the figures here")
    add("--jobs", type=int, default=1, help="seeds replayed at once, each in its own process")
    args = parser.parse_args(argv)
    default = ",".join(SEED_SCHEMES) if args.scenario == "seed" else "base,lru,lora-guard"
    schemes = [s for s in (args.schemes or default).split(",") if s]
    unknown = [s for s in schemes if s not in SCHEMES]
    if unknown:
        parser.error(f"unknown scheme {unknown[0]!r}; choose from {', '.join(SCHEMES)}")
    seeds = _seeds(parser, args)
    cache_memory = args.cache_memory  # bytes, or None
    spec = _spec(args)
    chosen = profile(args.profile)
    costs = read_costs(args.costs) if args.costs else chosen.costs
    with tempfile.TemporaryDirectory() as tmp:
        bench = _make_bench(Path(tmp), spec, args, chosen, costs)
        trace = read_trace(args.trace) if args.trace else None
        specs = [replace(spec, seed=seed) for seed in (seeds if trace is None else [seeds[0]])]
        work = partial(
            study, bench, schemes=schemes, load=args.load, trace=trace, cache_memory=cache_memory
        )
        if args.jobs > 1 and len(specs) > 1:
            # one process a seed (the figures are the same: each replay runs on its own clock)
            jobs = min(args.jobs, len(specs))
            with ProcessPoolExecutor(jobs, initializer=_one_thread) as workers:
                runs = list(workers.map(work, specs))
        else:
            runs = [work(s) for s in specs]
    out = report(runs, schemes)
    describe = None if args.trace else scenario(spec.scenario).describe
    if describe is not None and runs[0].rate is not None:
        print(f"{spec.scenario} workload: {describe(replace(spec, rate=runs[0].rate))}")
    out = {
        "scenario": "trace" if args.trace else spec.scenario,
        "seeds": None if args.trace else seeds,
        "requests": spec.requests,
        "max_loras": args.max_loras,
        "load": args.load,
        "profile": chosen.name,
        "model": chosen.shape.model,
        "bytes_scale": bench.scale,
        "costs": costs.source,
        **out,
    }
    rates = ", ".join(f"{r.rate:.3f}/s" for r in runs if r.rate is not None)
    print(
        f"virtual time: {out['scenario']}, seeds {out['seeds']}, {spec.requests} requests a "
        f"seed, load {args.load} (rate {rates or 'from the trace'} outside bursts), "
        f"max_loras {args.max_loras}; profile {chosen.name} ({chosen.shape.model}, bytes "
        f"{bench.scale:g}x the tiny model's); costs: {costs.source}"
    )
    for run in runs:
        if run.pressure:
            pool = run.pressure.summary()
            print(
                f"seed {run.seed}: pool {pool['cache_memory_mib']:.1f} MiB = KV "
                f"{pool['kv_mib']:.1f} + adapter room {pool['adapter_room_mib']:.1f}; adapters "
                f"in use over a minute {pool['in_use_per_minute_over_room_p50']:.1f}x the room "
                f"(median; 10th percentile {pool['in_use_per_minute_over_room_p10']:.1f}x)"
            )
    rows = list(out["schemes"].values())
    keys = ["scheme", *[k for k in rows[0] if k != "scheme"]] if rows else []
    print("| " + " | ".join(keys) + " |")
    print("|" + "---|" * len(keys))
    for scheme, row in out["schemes"].items():
        print("| " + " | ".join(_cell(scheme if k == "scheme" else row[k]) for k in keys) + " |")
    if "storm" in out:
        print(
            "other tenants' TTFT p95, storm / no storm: "
            + ", ".join(f"{s} {v:.2f}x" for s, v in out["storm"].items())
        )
    for name, ratio in out.get("lora_guard_over", {}).items():
        if name != "best_rival_by_seed":
            print(
                f"lora-guard / {name}: median {ratio['median']:.3f} (range "
                f"{ratio['range'][0]:.3f}-{ratio['range'][1]:.3f}; per seed "
                + ", ".join(f"{v:.3f}" for v in ratio["per_seed"])
                + ")"
            )
    if spec.scenario == "seed":
        out["seed_table"] = seed_table(out["schemes"], chosen)
        print_seed_table(out["seed_table"])
    if args.json:
        args.json.write_text(json.dumps(out, indent=2) + "\n")
    return 0


def seed_table(rows: dict[str, dict[str, Any]], chosen: Profile) -> dict[str, dict[str, Any]]:
    """The article's four columns for each scheme (medians over the seeds), the article's own
    figures beside: peak memory over the device's, adapter switch ms, P95 tokens/s (the decode
    speed 95% of requests beat), the cold failure ratio."""
    table = {}
    for scheme, row in rows.items():
        peak = chosen.weights_bytes + row["peak_pool_mib"] * MIB
        table[scheme] = {
            "peak_memory": peak / chosen.device_bytes,
            "switch_ms": row["switch_ms"],
            "p95_tokens_per_s": row["decode_tail_tokens_per_s"],
            "cold_fail_ratio": row["cold_fail_ratio"],
            "seed": SEED_FIGURES.get(scheme),
        }
    return table


def print_seed_table(table: dict[str, dict[str, Any]]) -> None:
    print(
        "| scheme | peak memory / device | adapter switch ms | P95 tokens/s | cold failure ratio |"
    )
    print("|---|---:|---:|---:|---:|")
    for scheme, row in table.items():
        seed = row["seed"] or {}

        def cell(value: float | None, theirs: float | None, digits: str) -> str:
            ours = "-" if value is None else format(value, digits)
            return ours if theirs is None else f"{ours} (seed {format(theirs, digits)})"

        print(
            f"| {scheme} | {cell(row['peak_memory'], seed.get('peak_memory'), '.2f')} | "
            f"{cell(row['switch_ms'], seed.get('switch_ms'), '.0f')} | "
            f"{cell(row['p95_tokens_per_s'], seed.get('p95_tokens_per_s'), '.1f')} | "
            f"{cell(row['cold_fail_ratio'], None, '.3f')} |"
        )


def _one_thread() -> None:
    import torch

    torch.set_num_threads(1)


def _seeds(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[int]:
    if args.seeds is not None and args.seed is not None:
        parser.error("give --seeds or --seed, not both")
    if args.seed is not None:
        return [args.seed]
    try:
        seeds = [int(s) for s in (args.seeds or "0").split(",") if s.strip()]
    except ValueError:
        parser.error(f"--seeds takes whole numbers such as 0,1,2, got {args.seeds!r}")
    if not seeds or len(set(seeds)) != len(seeds):
        parser.error(f"--seeds takes distinct whole numbers such as 0,1,2, got {args.seeds!r}")
    return seeds


def _spec(args: argparse.Namespace) -> WorkloadSpec:
    given = {
        k: v
        for k, v in (
            ("adapters", args.adapters),
            ("tenants", args.tenants),
            ("requests", args.requests),
        )
        if v is not None
    }
    chosen = scenario(args.scenario)
    spec = WorkloadSpec(
        requests=chosen.requests, output_mean=args.output_mean or chosen.output_mean
    )
    return chosen.apply(spec, **given)


def _make_bench(
    tmp: Path, spec: WorkloadSpec, args: argparse.Namespace, chosen: Profile, costs: Costs
) -> Bench:
    """A tiny model of the profile's proportions and the study's adapters: mixed ranks and
    targets for ``pressure``, ``public`` and a trace, ranks 4-16 on every projection otherwise."""
    from lora_guard.demo.adapters import make_adapters, named_specs, write_adapters

    model = tiny_model(tmp / "model", chosen)
    out = tmp / "adapters"
    if args.trace:
        folders = write_adapters(model, out, named_specs(trace_ranks(args.trace)), strength=0.5)
    elif scenario(spec.scenario).mixed_adapters:
        folders = make_adapters(
            model, out, n=spec.adapters, ranks=PRESSURE_RANKS, prefix="demo", strength=0.5
        )
    else:
        ranks = scenario(spec.scenario).ranks
        folders = make_adapters(
            model, out, n=spec.adapters, ranks=ranks, prefix="demo", all_projections=True
        )
    sizes = {f.name: weight_bytes(f) for f in folders}
    ids = [f.name for f in folders]
    return Bench(model, out, ids, chosen, costs, args.max_loras, chosen.shape.scale(model), sizes)


def tiny_model(out: Path, chosen: Profile) -> Path:
    """A random model of the profile's proportions whose tokenizer learnt the words the bench's
    prompts are made of, so a prompt takes about as many tokens as on a real model."""
    from lora_guard.demo.testing import make_tiny_llama

    config = chosen.shape.tiny_config()
    return make_tiny_llama(
        out, max_position_embeddings=4096, tokenizer_words=PROMPT_WORDS, **config
    )


def weight_bytes(folder: Path) -> int:
    """The tensor bytes of an adapter's safetensors files (their headers left out)."""
    total = 0
    for path in folder.glob("*.safetensors"):
        with path.open("rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        total += sum(
            end - start
            for k, v in header.items()
            if k != "__metadata__"
            for start, end in [v["data_offsets"]]
        )
    return total


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value)


if __name__ == "__main__":
    raise SystemExit(main())
