"""One engine replayed on a virtual clock: each step moves the clock by its modelled cost
(``Replay``), and what a replay of one scheme measured (``Result``)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from lora_guard.bench.load import RequestRecord
from lora_guard.bench.replay import Bind
from lora_guard.bench.replay_loop import replay_loop
from lora_guard.bench.report import decode_tokens_per_s, request_tokens_per_s, tail_ttft_shares
from lora_guard.plugins import hookimpl
from lora_guard.simulate_costs import MIB, Costs
from lora_guard.workload.bounds import compulsory_hit_bound
from lora_guard.workload.stats import percentile
from lora_guard.workload.trace import (
    TraceRequest,
)

IDLE_S = 100.0  # virtual seconds between the warm-up and the replay: the warm-up's heat is gone


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
    # what takes a run out of the class virtual/bound.py bounds: steps with a running request
    # parked (its adapter out of the pool), and running requests preempted (their KV freed)
    parked_steps: int = 0
    preemptions: int = 0

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
            "parked_steps": self.parked_steps,
            "preemptions": self.preemptions,
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
        self.start = clock.now  # when the replay began (set again by ``run``)
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
        self.parked_steps = 0  # see Result.parked_steps

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
        self.parked_steps += any(s.parked_since is not None for s in self.engine.scheduler.running)
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
        self.start = self.clock.now
        attempts = replay_loop(
            self.engine,
            trace,
            self,
            adapters,
            arrived=self._arrived,
            prompt=lambda r: self.llm.tokenizer.encode(r.prompt),
        )
        return list(attempts.records.values()), attempts.resent

    # the replay's clock (``replay_loop.ReplayClock``)
    def now(self) -> float:
        return self.clock.now - self.start

    def idle(self, until: float) -> None:
        """Nothing runs until the next arrival: the clock jumps to it (``now`` reads ``until``
        or a hair after: ``start + until - start`` can round below ``until``)."""
        jump = self.start + until
        while jump - self.start < until:
            jump = math.nextafter(jump, math.inf)
        self.clock.now = jump

    def _arrived(self, record: RequestRecord) -> None:
        if record.adapter_id is not None:
            self.arrivals.append(
                (record.adapter_id, record.adapter_id in self.engine.figures().resident)
            )


def warm_up(replay: Replay, adapter_ids: Sequence[str]) -> None:
    """Every adapter read into host memory once, as the bench's warm-up does."""
    from lora_guard.engine import SamplingParams

    params = SamplingParams(max_new_tokens=1, ignore_eos=True)
    for i, adapter in enumerate(adapter_ids):
        replay.engine.add_request(f"warm-{i}", [5, 6, 7], params, adapter)
    while replay.engine.has_unfinished_requests():
        replay.step()
    replay.clock.now += IDLE_S
