"""The hit-rate bounds: no policy that loads what a request asks for, started from the same
adapters, hits more often than them."""

from __future__ import annotations

import random
from collections import Counter, OrderedDict

from hypothesis import given, settings
from hypothesis import strategies as st

from lora_guard.workload.bounds import (
    belady_hits,
    compulsory_hit_bound,
    independent_optimum_hit_rate,
    zipf_trace,
)


def lru_hits(trace: list[int], slots: int, start: list[int]) -> int:
    resident: OrderedDict[int, None] = OrderedDict((a, None) for a in start[:slots])
    hits = 0
    for adapter in trace:
        if adapter in resident:
            hits += 1
            resident.move_to_end(adapter)
            continue
        if len(resident) >= slots:
            resident.popitem(last=False)
        resident[adapter] = None
    return hits


def mru_hits(trace: list[int], slots: int, start: list[int]) -> int:
    """Evicts the most recently used: the best online policy on a loop over one more adapter
    than there are slots. Like the engine, it must load every adapter a request asks for."""
    resident = list(start[:slots])  # oldest use first
    hits = 0
    for adapter in trace:
        if adapter in resident:
            hits += 1
            resident.remove(adapter)
        elif len(resident) >= slots:
            resident.pop()
        resident.append(adapter)
    return hits


traces = st.lists(st.integers(0, 9), min_size=1, max_size=60)
starts = st.lists(st.integers(0, 9), max_size=6, unique=True)


@settings(max_examples=300, deadline=None)
@given(trace=traces, slots=st.integers(1, 6), start=starts)
def test_no_policy_beats_belady_from_the_same_start(
    trace: list[int], slots: int, start: list[int]
) -> None:
    best = belady_hits(trace, slots, start)
    assert best >= lru_hits(trace, slots, start)
    assert best >= mru_hits(trace, slots, start)
    assert best / len(trace) <= compulsory_hit_bound(trace, start[:slots]) + 1e-12


@settings(max_examples=300, deadline=None)
@given(trace=traces, slots=st.integers(1, 6), start=starts, seed=st.integers(0, 2**32))
def test_deferring_and_bypassing_policies_never_pass_the_compulsory_bound(
    trace: list[int], slots: int, start: list[int], seed: int
) -> None:
    """A policy may serve any of the next four requests first (defer) and serve a miss without
    keeping its adapter (bypass); the adapters it keeps and evicts are random. Belady on the
    arrival order does not bound it; the compulsory bound does."""
    rng = random.Random(seed)
    pending, resident, hits = list(trace), list(start[:slots]), 0
    while pending:
        adapter = pending.pop(rng.randrange(min(len(pending), 4)))
        if adapter in resident:
            hits += 1
        elif rng.random() >= 0.3:  # else bypassed
            if len(resident) >= slots:
                resident.pop(rng.randrange(len(resident)))
            resident.append(adapter)
    assert hits / len(trace) <= compulsory_hit_bound(trace, start[:slots]) + 1e-12


def test_a_deferring_policy_beats_belady_on_the_arrival_order() -> None:
    # One seat holding B; A arrives, then B. Belady in arrival order evicts B for A: no hit.
    # Serving B first, then A, scores one: Belady on the arrival order is no bound.
    assert belady_hits(["A", "B"], 1, start=["B"]) == 0
    assert compulsory_hit_bound(["A", "B"], start=["B"]) == 0.5


def test_a_warm_start_raises_the_bound_above_the_cold_one() -> None:
    # 4 distinct adapters, 2 slots: from cold the first use of each misses.
    trace = [0, 1, 0, 1, 2, 3, 2, 3]
    assert belady_hits(trace, 2) == 4
    assert belady_hits(trace, 2, start=[0, 1]) == 6
    assert compulsory_hit_bound(trace) == 0.5
    assert compulsory_hit_bound(trace, start=[0, 1]) == 0.75
    # A start state larger than the slots keeps only as many adapters as there are slots.
    assert belady_hits([5], 1, start=[5, 6]) == 1


def test_the_independent_optimum_keeps_the_most_probable_and_rotates_one_seat() -> None:
    weights = {0: 0.5, 1: 0.3, 2: 0.1, 3: 0.1}
    # Two seats: 0 is kept (misses once), the other seat holds the latest of 1, 2, 3.
    trace = [0, 1, 1, 0, 2, 1, 0, 3, 3]
    assert independent_optimum_hit_rate(trace, 2, weights) == 4 / 9  # 1, 0, 0, 3 hit
    assert independent_optimum_hit_rate([], 2, weights) == 0.0


def test_no_online_policy_beats_the_independent_optimum_on_average() -> None:
    """On Zipf traces (requests drawn independently), A0 with the true probabilities hits at
    least as often as LRU and as LFU, averaged over fresh traces."""
    base = random.randrange(1_000_000)
    print(f"traces drawn from seed {base}")
    slots, adapters, exponent = 8, 24, 1.0
    weights = {i: 1 / (i + 1) ** exponent for i in range(adapters)}
    a0 = lru = lfu = 0.0
    for k in range(40):
        trace = zipf_trace(adapters, 480, exponent, seed=base + k)
        a0 += independent_optimum_hit_rate(trace, slots, weights)
        lru += lru_hits(trace, slots, []) / len(trace)
        lfu += lfu_hits(trace, slots) / len(trace)
    assert a0 >= lru and a0 >= lfu, (a0 / 40, lru / 40, lfu / 40)


def lfu_hits(trace: list[int], slots: int) -> int:
    """Evicts the resident adapter with the fewest requests so far (the least recent of ties)."""
    counts: Counter[int] = Counter()
    resident: list[int] = []  # least recent use first
    hits = 0
    for adapter in trace:
        counts[adapter] += 1
        if adapter in resident:
            hits += 1
            resident.remove(adapter)
        elif len(resident) >= slots:
            resident.remove(min(resident, key=lambda a: (counts[a], resident.index(a))))
        resident.append(adapter)
    return hits
