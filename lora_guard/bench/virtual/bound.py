"""A lower bound on the TTFT p95 of any schedule of a trace on a pool, for the targets a study
cannot reach: no order of admission, batching or eviction, knowing the whole trace, gets under it.

It holds for every schedule that runs a request to its end once it starts (none parks a
running request's adapter or preempts its KV; a replay counts both, ``Result.parked_steps`` and
``Result.preemptions``), on the same pool and the same step costs. Each request is a job:
it starts no earlier than its arrival; from its start its adapter's pages and the prompt blocks
no other request of its adapter could share stay in the pool for at least its run alone (its
prefill step and each decode step with nothing else in the batch); its first token comes no
sooner than its prefill step alone, with every block it could share already cached; prefills
that must all happen inside a window take the window's time at least. A time-indexed linear
relaxation of those jobs (starts on a grid of ``slot_s``, memory checked at the grid's instants,
a fraction of a request allowed) is solved with HiGHS: where no fractional schedule lets enough
requests meet a TTFT for the 95th percentile to stay under it, no real one does. The bound leaves
out what it cannot write linearly (steps that slow as the batch grows, adapter loads, KV of
generated tokens), so it is low; how low shows beside the schemes' figures.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from lora_guard.simulate_costs import MIB, Costs
from lora_guard.workload.trace import TraceRequest

SLOT_S = 0.1  # the grid of starts and memory instants
TOLERANCE_S = 0.005  # the search stops when the bound is known to this
WINDOW_S = 10.0  # prefill windows checked: those up to this long
LONGEST_S = 86400.0  # the search gives up past this (a pool that cannot hold the trace's adapters)


@dataclass(frozen=True)
class Job:
    """What any schedule must give one request, at least."""

    arrival: float  # seconds
    adapter: str | None
    prefill_s: float  # its prefill step alone: first token this long after it starts
    run_s: float  # its prefill and decode steps alone: it holds its pages this long
    pages: int  # its adapter's and its unshared prompt blocks', in the pool
    adapter_pages: int
    prefill_work_s: float  # what its prefill adds to any step it joins


def shared_prefix(tokens: Sequence[int], others: Sequence[Sequence[int]]) -> int:
    """The longest prefix ``tokens`` has in common with any of ``others``."""
    best = 0
    for other in others:
        n = 0
        for a, b in zip(tokens, other, strict=False):
            if a != b:
                break
            n += 1
        best = max(best, n)
    return best


def make_jobs(
    trace: Sequence[TraceRequest],
    tokens: Mapping[str, Sequence[int]],
    adapter_pages: Mapping[str, int],
    adapter_mib: Mapping[str, float],
    costs: Costs,
    block_size: int,
) -> list[Job]:
    """One job a request. Prefix blocks are shared only between requests of one adapter (the
    keys are scoped by adapter): a request's prefill computes at least what lies past its
    longest prefix in common with any other such request (whole blocks; one token at least),
    and holds at least the blocks past it."""
    by_adapter: dict[str | None, list[str]] = defaultdict(list)
    for r in trace:
        by_adapter[r.adapter_id].append(r.id)
    jobs = []
    for r in trace:
        prompt = tokens[r.id]
        others = [tokens[o] for o in by_adapter[r.adapter_id] if o != r.id]
        shared = shared_prefix(prompt, others)
        computed = len(prompt) - min(shared, len(prompt) - 1) // block_size * block_size
        held = math.ceil(len(prompt) / block_size) - min(shared, len(prompt)) // block_size
        seat = 0 if r.adapter_id is None else adapter_pages[r.adapter_id]
        mib = 0.0 if r.adapter_id is None else adapter_mib[r.adapter_id]
        decode_ms = costs.step(1, int(r.adapter_id is not None), 0, mib)
        prefill_ms = decode_ms + costs.prefill_per_token_ms * computed
        jobs.append(
            Job(
                arrival=r.time,
                adapter=r.adapter_id,
                prefill_s=prefill_ms / 1000,
                run_s=(prefill_ms + (r.max_new_tokens - 1) * decode_ms) / 1000,
                pages=seat + held,
                adapter_pages=seat,
                prefill_work_s=(costs.prefill_per_token_ms * computed + costs.step_per_seq_ms)
                / 1000,
            )
        )
    return jobs


def meeting(n: int, q: float = 95) -> int:
    """How many of ``n`` first tokens must come within a TTFT for the ``q``-th percentile
    (interpolated, as ``workload.stats.percentile``) to be within it."""
    return math.floor((n - 1) * q / 100) + 1


def feasible(jobs: Sequence[Job], pool_pages: int, ttft_s: float, slot_s: float = SLOT_S) -> bool:
    """Whether a fractional schedule on the grid lets ``meeting(len(jobs))`` requests have their
    first token within ``ttft_s`` (the others left out: they may run after the trace)."""
    import highspy
    import numpy as np

    starts: dict[int, list[tuple[int, int]]] = defaultdict(list)  # job -> (slot, column)
    columns = 0
    for i, job in enumerate(jobs):
        latest = job.arrival + ttft_s - job.prefill_s
        if latest < job.arrival or job.pages > pool_pages:
            continue
        for k in range(math.floor(job.arrival / slot_s), math.floor(latest / slot_s) + 1):
            starts[i].append((k, columns))
            columns += 1
    need = meeting(len(jobs))
    if len(starts) < need:
        return False
    rows: list[tuple[float, float, dict[int, float]]] = []
    seats: dict[tuple[str | None, int], int] = {}  # (adapter, instant) -> its column
    memory: dict[int, dict[int, float]] = defaultdict(dict)  # instant -> column -> pages
    for i, slots in starts.items():
        job = jobs[i]
        rows.append((-math.inf, 1.0, {c: 1.0 for _, c in slots}))
        # a start in slot k certainly runs at instants k+1 .. k+m-1 (m whole slots of its run)
        runs: dict[int, list[int]] = defaultdict(list)
        last = math.floor(job.run_s / slot_s)
        for k, c in slots:
            for j in range(k + 1, k + last):
                runs[j].append(c)
        for j, cs in runs.items():
            if job.adapter is not None:
                seat = seats.setdefault((job.adapter, j), columns + len(seats))
                rows.append((-math.inf, 0.0, {**{c: 1.0 for c in cs}, seat: -1.0}))
                memory[j][seat] = float(job.adapter_pages)
            for c in cs:
                memory[j][c] = float(job.pages - job.adapter_pages)
    rows.append((float(need), math.inf, {c: 1.0 for s in starts.values() for _, c in s}))
    rows.extend((-math.inf, float(pool_pages), used) for used in memory.values())
    order = sorted(starts, key=lambda i: jobs[i].arrival)
    for first, i in enumerate(order):
        window: dict[int, float] = {}
        for other in order[first:]:
            if jobs[other].arrival - jobs[i].arrival > WINDOW_S:
                break
            for _, c in starts[other]:
                window[c] = jobs[other].prefill_work_s
            if len(window) > len(starts[i]):
                span = jobs[other].arrival + ttft_s - jobs[i].arrival
                rows.append((-math.inf, span, dict(window)))
    total = columns + len(seats)
    lp = highspy.HighsLp()
    lp.num_col_, lp.num_row_ = total, len(rows)
    lp.col_cost_ = np.zeros(total)
    lp.col_lower_, lp.col_upper_ = np.zeros(total), np.ones(total)
    lp.row_lower_ = np.array([lo for lo, _, _ in rows])
    lp.row_upper_ = np.array([hi for _, hi, _ in rows])
    matrix = lp.a_matrix_
    matrix.format_ = highspy.MatrixFormat.kRowwise
    matrix.num_col_, matrix.num_row_ = total, len(rows)
    matrix.start_ = np.cumsum([0, *(len(e) for _, _, e in rows)], dtype=np.int32)
    matrix.index_ = np.array([c for _, _, e in rows for c in e], dtype=np.int32)
    matrix.value_ = np.array([v for _, _, e in rows for v in e.values()])
    solver = highspy.Highs()
    solver.setOptionValue("output_flag", False)
    solver.passModel(lp)
    solver.run()
    status = solver.getModelStatus()
    if status not in (highspy.HighsModelStatus.kOptimal, highspy.HighsModelStatus.kInfeasible):
        raise RuntimeError(f"the relaxation did not solve: {solver.modelStatusToString(status)}")
    return bool(status == highspy.HighsModelStatus.kOptimal)


def ttft_p95_bound_ms(jobs: Sequence[Job], pool_pages: int, slot_s: float = SLOT_S) -> float:
    """The largest TTFT (ms, to ``TOLERANCE_S``) that no schedule's p95 is within."""
    fitting = sum(1 for job in jobs if job.pages <= pool_pages)
    if fitting < meeting(len(jobs)):
        raise ValueError(
            f"{len(jobs) - fitting} of {len(jobs)} requests need more than the pool's "
            f"{pool_pages} pages: no schedule serves enough of them for a TTFT p95"
        )
    low, high = 0.0, 1.0
    while not feasible(jobs, pool_pages, high, slot_s):
        if high > LONGEST_S:
            raise ValueError(f"no schedule on {pool_pages} pages has a TTFT p95 within a day")
        low, high = high, high * 2
    while high - low > TOLERANCE_S:
        middle = (low + high) / 2
        if feasible(jobs, pool_pages, middle, slot_s):
            high = middle
        else:
            low = middle
    return low * 1000


def trace_bound(bench: Any, trace: Sequence[TraceRequest], cache_memory: int) -> dict[str, Any]:
    """The bound for ``trace`` on a pool of ``cache_memory`` bytes of ``bench``'s model, with the
    facts it took from the engine: the pool's pages, each adapter's, the prompts' tokens."""
    from lora_guard.bench.virtual.replay import VirtualClock, warm_up

    asked = sorted({r.adapter_id for r in trace if r.adapter_id})
    clock = VirtualClock()
    llm = bench.llm(clock, "lru", cache_memory, 0)
    warm_up(bench.replay(llm, clock), asked)
    engine = llm.engine
    host = engine.scheduler.adapters.host.entries
    mib = {a: engine.adapter_page_bytes(host[a]) * bench.scale / MIB for a in asked}
    blocks = engine.scheduler.blocks
    jobs = make_jobs(
        trace,
        {r.id: llm.tokenizer.encode(r.prompt) for r in trace},
        engine.adapter_pages(asked),
        mib,
        bench.costs,
        blocks.block_size,
    )
    pool_pages = blocks.num_blocks
    engine.shutdown()
    return {
        "ttft_p95_ms": ttft_p95_bound_ms(jobs, pool_pages),
        "pool_pages": pool_pages,
        "slot_s": SLOT_S,
        "alone_prefill_p95_ms": sorted(j.prefill_s for j in jobs)[meeting(len(jobs)) - 1] * 1000,
    }
