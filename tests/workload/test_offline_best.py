"""The offline best: Belady's loads over the pooled seats, a lower bound for any router."""

from __future__ import annotations

import random
from collections import OrderedDict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lora_guard.workload.bounds import offline_best_loads


def test_belady_over_pooled_seats_on_a_small_trace() -> None:
    trace = ["a", "b", "a", "c", "a", "b", None]
    # One seat each of two replicas = two pooled seats: a, b, then c evicts b (used later than
    # a), then b again: four loads. The base model's request needs none.
    assert offline_best_loads(trace, replicas=1, seats=2) == 4
    assert offline_best_loads(trace, replicas=2, seats=1) == 4
    # As many pooled seats as adapters: each is loaded once.
    assert offline_best_loads(trace, replicas=3, seats=1) == 3
    assert offline_best_loads([None, None], replicas=2, seats=2) == 0


def test_bad_sizes_are_refused() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        offline_best_loads(["a"], replicas=0, seats=2)


def fleet_loads(trace: list[str], replicas: int, seats: int, seed: int) -> int:
    """Loads of a fleet with a random router and LRU in each replica (any real fleet does
    at least as well as the pooled optimum allows, never better)."""
    rng = random.Random(seed)
    caches: list[OrderedDict[str, None]] = [OrderedDict() for _ in range(replicas)]
    loads = 0
    for adapter in trace:
        holders = [c for c in caches if adapter in c]
        cache = rng.choice(holders) if holders and rng.random() < 0.7 else rng.choice(caches)
        if adapter in cache:
            cache.move_to_end(adapter)
            continue
        if len(cache) >= seats:
            cache.popitem(last=False)
        cache[adapter] = None
        loads += 1
    return loads


@settings(max_examples=200, deadline=None)
@given(
    trace=st.lists(st.sampled_from("abcdefgh"), max_size=60),
    replicas=st.integers(1, 4),
    seats=st.integers(1, 3),
    seed=st.integers(0, 1000),
)
def test_no_fleet_loads_less_than_the_offline_best(
    trace: list[str], replicas: int, seats: int, seed: int
) -> None:
    best = offline_best_loads(trace, replicas, seats)
    assert len(set(trace)) <= best <= len(trace)
    assert best <= fleet_loads(trace, replicas, seats, seed)
