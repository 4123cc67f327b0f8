"""The hit-rate bounds: no policy that loads what a request asks for, started from the same
adapters, hits more often than them."""

from __future__ import annotations

from collections import OrderedDict

from hypothesis import given, settings
from hypothesis import strategies as st

from lora_guard.bench.hit_rate import belady_hits, compulsory_hit_bound


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


def test_a_warm_start_raises_the_bound_above_the_cold_one() -> None:
    # 4 distinct adapters, 2 slots: from cold the first use of each misses.
    trace = [0, 1, 0, 1, 2, 3, 2, 3]
    assert belady_hits(trace, 2) == 4
    assert belady_hits(trace, 2, start=[0, 1]) == 6
    assert compulsory_hit_bound(trace) == 0.5
    assert compulsory_hit_bound(trace, start=[0, 1]) == 0.75
    # A start state larger than the slots keeps only as many adapters as there are slots.
    assert belady_hits([5], 1, start=[5, 6]) == 1
