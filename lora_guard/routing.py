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
concurrent cold requests for different adapters do not overfill one replica. A load routed to a
replica with no room evicts one of its adapters: the ranker expects the one it routed there
least recently to leave, and counts it gone until a report taken after that load (the replica's
``loads`` grew) says what is resident, so requests for it stop following a report the load made
stale.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from lora_guard.clock import monotonic


@dataclass(frozen=True, slots=True)
class ReplicaView:
    replica_id: str
    resident: frozenset[str]
    queue_len: int  # requests on the replica, running or waiting
    max_queue: int  # from this many on it counts as overloaded
    free_seats: int  # adapters it can load without evicting one
    cold_budget_left: int  # loads its cold-load budget allows now
    loads: int = 0  # adapters it has loaded since it started, as of this report


class AffinityRanker:
    def __init__(
        self,
        spread_queue: int = 4,
        reservation_s: float = 10.0,
        clock: Callable[[], float] = monotonic,
    ) -> None:
        if spread_queue < 1:
            raise ValueError("spread_queue must be at least 1")
        self.spread_queue, self.reservation_s, self.clock = spread_queue, reservation_s, clock
        self._loading: dict[tuple[str, str], float] = {}  # (replica, adapter) -> until
        self._leaving: dict[tuple[str, str], tuple[float, int]] = {}  # -> until, loads then
        self._last_routed: dict[tuple[str, str], float] = {}

    def rank(self, adapter_id: str | None, replicas: Sequence[ReplicaView]) -> list[list[str]]:
        """Replica ids in tiers, best first (empty tiers left out)."""
        if adapter_id is None:  # the base model: any replica, shortest queue first
            return [[r.replica_id for r in sorted(replicas, key=_queue)]] if replicas else []
        self._expire()
        self._forget_gone(replicas)
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
        """Resident there, or a load of it routed from here is on its way; not where a load
        routed from here is expected to have evicted it."""
        if self._left(replica, adapter_id):
            return False
        if adapter_id in replica.resident:
            self._loading.pop((replica.replica_id, adapter_id), None)
            return True
        return (replica.replica_id, adapter_id) in self._loading

    def room(self, replica: ReplicaView) -> int:
        """Adapters the replica can still load without evicting one, less the loads reserved
        there that it does not report yet."""
        rid = replica.replica_id
        reserved = sum(1 for r, a in self._loading if r == rid and a not in replica.resident)
        marked = [a for r, a in self._leaving if r == rid and a in replica.resident]
        leaving = sum(1 for a in marked if self._left(replica, a))
        return replica.free_seats - reserved + leaving

    def routed(self, adapter_id: str | None, replica: ReplicaView) -> None:
        """A request for ``adapter_id`` went to ``replica``: reserve its load there if needed,
        and expect the adapter routed there least recently to leave if it has no room."""
        if adapter_id is None:
            return
        key, now = (replica.replica_id, adapter_id), self.clock()
        if not self.holds(replica, adapter_id):
            if self.room(replica) <= 0:
                self._expect_eviction(replica, adapter_id, now)
            self._leaving.pop(key, None)
            self._loading[key] = now + self.reservation_s
        self._last_routed[key] = now

    def _expect_eviction(self, replica: ReplicaView, incoming: str, now: float) -> None:
        rid = replica.replica_id
        held = {a for a in replica.resident if not self._left(replica, a)}
        held |= {a for r, a in self._loading if r == rid}
        held.discard(incoming)
        if not held:
            return
        victim = min(held, key=lambda a: (self._last_routed.get((rid, a), -math.inf), a))
        self._loading.pop((rid, victim), None)
        if victim in replica.resident:
            self._leaving[rid, victim] = (now + self.reservation_s, replica.loads)

    def _left(self, replica: ReplicaView, adapter_id: str) -> bool:
        """A load routed here is expected to have evicted it, and no report since says."""
        key = (replica.replica_id, adapter_id)
        mark = self._leaving.get(key)
        if mark is None:
            return False
        until, loads = mark
        if replica.loads > loads or until <= self.clock():
            del self._leaving[key]
            return False
        return True

    def _forget_gone(self, replicas: Sequence[ReplicaView]) -> None:
        """When each adapter was last routed matters only where it is held: forget the rest of
        what ``replicas`` report, so the record stays the size of their resident sets."""
        shown = {r.replica_id: r.resident for r in replicas}
        gone = [
            (rid, a)
            for rid, a in self._last_routed
            if rid in shown and a not in shown[rid] and (rid, a) not in self._loading
        ]
        for key in gone:
            del self._last_routed[key]

    def _expire(self) -> None:
        now = self.clock()
        for key in [k for k, until in self._loading.items() if until <= now]:
            del self._loading[key]
        for key in [k for k, (until, _) in self._leaving.items() if until <= now]:
            del self._leaving[key]


def _queue(replica: ReplicaView) -> tuple[int, str]:
    return replica.queue_len, replica.replica_id
