"""Which replicas should serve a request for an adapter, best first.

A replica reports what the router needs (``ReplicaView``): the adapters resident in its pool,
its queue, how many adapters it can still load without evicting one, and its cold-load budget.
``AffinityRanker.rank`` sorts the replicas into tiers:

1. the adapter is resident there (or a load of it, routed from here, is on its way) and the
   replica is not overloaded;
2. the replica can load the adapter without evicting another;
3. its cold-load budget allows a load now;
4. every other replica.

Within a tier the shortest queue comes first. A hot adapter spreads: once every replica that
holds it has ``spread_queue`` requests or more waiting, replicas with room to load it join the
first tier, so its traffic is not piled onto one replica. A request routed to a replica that
lacks its adapter reserves that load (``routed``): until the replica reports the adapter, or
``reservation_s`` passes, the adapter counts as resident there, so concurrent cold requests for
it do not load it on two replicas, and the seat it will take no longer counts as free there, so
concurrent cold requests for different adapters do not overfill one replica.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ReplicaView:
    replica_id: str
    resident: frozenset[str]
    queue_len: int  # requests on the replica, running or waiting
    max_queue: int  # from this many on it counts as overloaded
    free_seats: int  # adapters it can load without evicting one
    cold_budget_left: int  # loads its cold-load budget allows now


class AffinityRanker:
    def __init__(
        self,
        spread_queue: int = 4,
        reservation_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if spread_queue < 1:
            raise ValueError("spread_queue must be at least 1")
        self.spread_queue, self.reservation_s, self.clock = spread_queue, reservation_s, clock
        self._loading: dict[tuple[str, str], float] = {}  # (replica, adapter) -> until

    def rank(self, adapter_id: str | None, replicas: Sequence[ReplicaView]) -> list[list[str]]:
        """Replica ids in tiers, best first (empty tiers left out)."""
        if adapter_id is None:  # the base model: any replica, shortest queue first
            return [[r.replica_id for r in sorted(replicas, key=_queue)]] if replicas else []
        self._expire()
        holding = {r.replica_id: r for r in replicas if self.holds(r, adapter_id)}
        spread = bool(holding) and all(r.queue_len >= self.spread_queue for r in holding.values())
        tiers: list[list[ReplicaView]] = [[], [], [], []]
        for replica in replicas:
            overloaded = replica.queue_len >= replica.max_queue
            if replica.replica_id in holding and not overloaded:
                tiers[0].append(replica)
            elif self.room(replica) > 0 and not overloaded:
                tiers[0 if spread else 1].append(replica)
            elif replica.cold_budget_left > 0 and not overloaded:
                tiers[2].append(replica)
            else:
                tiers[3].append(replica)
        return [[r.replica_id for r in sorted(tier, key=_queue)] for tier in tiers if tier]

    def holds(self, replica: ReplicaView, adapter_id: str) -> bool:
        """Resident there, or a load of it routed from here is on its way."""
        if adapter_id in replica.resident:
            self._loading.pop((replica.replica_id, adapter_id), None)
            return True
        return (replica.replica_id, adapter_id) in self._loading

    def room(self, replica: ReplicaView) -> int:
        """Adapters the replica can still load without evicting one, less the loads reserved
        there that it does not report yet."""
        reserved = sum(
            1 for r, a in self._loading if r == replica.replica_id and a not in replica.resident
        )
        return replica.free_seats - reserved

    def routed(self, adapter_id: str | None, replica: ReplicaView) -> None:
        """A request for ``adapter_id`` went to ``replica``: reserve its load there if needed."""
        if adapter_id is not None and adapter_id not in replica.resident:
            self._loading[replica.replica_id, adapter_id] = self.clock() + self.reservation_s

    def _expire(self) -> None:
        now = self.clock()
        for key in [k for k, until in self._loading.items() if until <= now]:
            del self._loading[key]


def _queue(replica: ReplicaView) -> tuple[int, str]:
    return replica.queue_len, replica.replica_id
