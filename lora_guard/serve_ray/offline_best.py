"""The fewest adapter loads a fleet of replicas could make on a trace: the yardstick for routers.

``offline_best_loads(adapters, replicas, seats)`` is the loads of Belady's optimal eviction over
one pool of ``replicas * seats`` seats, starting empty, on the trace's adapter ids in order (the
base model's requests, None, need none). It is a lower bound for any router and any eviction in
the replicas, on that order of uses: the adapters resident across the fleet at any moment are at
most ``replicas * seats`` distinct ones, so the fleet can be read as one pooled cache that loads
only when no replica holds the adapter, and Belady's is the fewest loads such a cache can make.
A fleet that loads an adapter again on a second replica, or evicts one it needs again, only adds
to it.

The order is the order of the uses. An engine that serves the requests in flight in another
order (batching those of a resident adapter first) uses its adapters in a slightly different
order; when the trace names no more distinct adapters than the pooled seats, as the integration
test's does, the bound is the number of distinct adapters, which no order can beat.
"""

from __future__ import annotations

from collections.abc import Sequence

from lora_guard.bench.hit_rate import belady_hits


def offline_best_loads(adapters: Sequence[str | None], replicas: int, seats: int) -> int:
    """Belady's loads over ``replicas * seats`` pooled seats on the adapter ids of a trace."""
    if replicas < 1 or seats < 1:
        raise ValueError("replicas and seats must be at least 1")
    uses = [a for a in adapters if a is not None]
    return len(uses) - belady_hits(uses, replicas * seats)
