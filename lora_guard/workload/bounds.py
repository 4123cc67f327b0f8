"""Adapter hit rates on a trace: Zipf traces and the bounds no caching policy can beat.

A *bind* is one moment a request needs its adapter in the cache pool: when it first asks, and again
each time it finds the adapter gone (parked). A policy that loads an adapter only for a bind that
missed cannot hit more often, on its own sequence of binds and from its own start state, than
Belady's offline optimum on that sequence with the same slots and start; nor more often than every
bind but the first of each adapter that was not resident at the start (the compulsory misses).

``offline_best_loads(adapters, replicas, seats)``, the yardstick for routers, is the loads of
Belady's optimal eviction over one pool of ``replicas * seats`` seats, starting empty, on the
trace's adapter ids in order (the base model's requests, None, need none). It is a lower bound for
any router and any eviction in the replicas, on that order of uses: the adapters resident across
the fleet at any moment are at most ``replicas * seats`` distinct ones, so the fleet can be read as
one pooled cache that loads only when no replica holds the adapter. An engine that serves the
requests in flight in another order (batching those of a resident adapter first) uses its
adapters in a slightly different order; when the trace names no more distinct adapters than the
pooled seats, the bound is the number of distinct adapters, which no order can beat.
"""

from __future__ import annotations

import math
import random
from collections import Counter, OrderedDict
from collections.abc import Collection, Sequence


def zipf_trace(num_adapters: int, length: int, exponent: float = 1.0, seed: int = 0) -> list[int]:
    """Adapter indices drawn with Zipf popularity: adapter ``i`` has weight ``1 / (i+1)**s``."""
    rng = random.Random(seed)
    weights = [1 / (i + 1) ** exponent for i in range(num_adapters)]
    return rng.choices(range(num_adapters), weights=weights, k=length)


def belady_hits(trace: Sequence[object], slots: int, start: Collection[object] = ()) -> int:
    """Hits of the optimal offline policy, starting with ``start`` resident: on a miss with every
    slot taken, evict the adapter used furthest ahead."""
    if slots < 1:
        return 0
    next_use: list[float] = [0.0] * len(trace)
    last: dict[object, float] = {}
    for i in range(len(trace) - 1, -1, -1):
        next_use[i] = last.get(trace[i], math.inf)
        last[trace[i]] = i
    resident = {a: last.get(a, math.inf) for a in list(start)[:slots]}
    hits = 0
    for i, adapter in enumerate(trace):
        if adapter in resident:
            hits += 1
        elif len(resident) >= slots:
            del resident[max(resident, key=resident.__getitem__)]
        resident[adapter] = next_use[i]
    return hits


def belady_hit_rate(trace: Sequence[object], slots: int, start: Collection[object] = ()) -> float:
    """:func:`belady_hits` as a share of the trace (0.0 for an empty trace)."""
    return belady_hits(trace, slots, start) / len(trace) if trace else 0.0


def known_popularity_hit_rate(trace: Sequence[object], slots: int) -> float:
    """The hit rate of the best policy that knows each adapter's share of the whole trace but
    not its order: the ``k`` most used adapters kept (each missing once), the other ``slots -
    k`` seats least recently used for the rest, the best ``k`` below ``slots`` (a request for
    any adapter must find a seat). What frequency can reach; Belady's order knowledge is above
    it."""
    if not trace:
        return 0.0
    ranked = [a for a, _ in Counter(trace).most_common()]
    best = 0
    for keep in range(slots):
        kept, rotating, hits = set(ranked[:keep]), OrderedDict[object, None](), -keep
        for adapter in trace:
            if adapter in kept:
                hits += 1
            elif adapter in rotating:
                hits += 1
                rotating.move_to_end(adapter)
            else:
                if len(rotating) >= slots - keep:
                    rotating.popitem(last=False)
                rotating[adapter] = None
        best = max(best, hits)
    return best / len(trace)


def independent_optimum_hit_rate(
    trace: Sequence[object], slots: int, weights: dict[object, float]
) -> float:
    """The hit rate on ``trace`` of the best online policy when requests are drawn independently
    with the probabilities ``weights`` (normalised or not) and the policy knows them: Aho, Denning
    and Ullman's A0, which keeps the ``slots - 1`` most probable adapters once loaded and gives
    the last seat to the latest request for any other. No online policy hits more often in
    expectation on such a trace (a lucky one may, on one trace); Belady's, which knows the order,
    is above it."""
    if not trace or slots < 1:
        return 0.0
    kept = set(sorted(weights, key=lambda a: -weights[a])[: slots - 1])
    loaded: set[object] = set()
    last, hits = None, 0
    for adapter in trace:
        if adapter in kept:
            hits += adapter in loaded
            loaded.add(adapter)
        else:
            hits += adapter == last
            last = adapter
    return hits / len(trace)


def learned_frequency_hit_rate(trace: Sequence[object], slots: int) -> float:
    """The hit rate of a policy that learns the popularities as it goes: every request counted
    from the start (no window), the adapter counted least often leaving (least recent first
    among ties), one request at a time. What an online policy without the true popularities
    reaches on a trace of independent requests; :func:`independent_optimum_hit_rate` is above
    it in expectation."""
    counts: Counter[object] = Counter()
    last: dict[object, int] = {}
    resident: set[object] = set()
    hits = 0
    for i, adapter in enumerate(trace):
        counts[adapter] += 1
        if adapter in resident:
            hits += 1
        else:
            if len(resident) >= slots:
                resident.remove(min(resident, key=lambda a: (counts[a], last[a])))
            resident.add(adapter)
        last[adapter] = i
    return hits / len(trace) if trace else 0.0


def compulsory_hit_bound(trace: Sequence[object], start: Collection[object] = ()) -> float:
    """The hit rate with only compulsory misses: each adapter not resident at the start misses
    once, whatever the slots (1.0 for an empty trace)."""
    if not trace:
        return 1.0
    first_reads = len(set(trace) - set(start))
    return (len(trace) - first_reads) / len(trace)


def offline_best_loads(adapters: Sequence[str | None], replicas: int, seats: int) -> int:
    """Belady's loads over ``replicas * seats`` pooled seats on the adapter ids of a trace."""
    if replicas < 1 or seats < 1:
        raise ValueError("replicas and seats must be at least 1")
    uses = [a for a in adapters if a is not None]
    return len(uses) - belady_hits(uses, replicas * seats)
