"""How the simulated router picks a replica: lora-guard's ranking or power of two choices (with
Ray Serve's multiplexed ranks or none)."""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Protocol

from lora_guard.routing import AffinityRanker, ReplicaView

if TYPE_CHECKING:
    pass

ROUTERS = ("lora-guard", "ray-multiplex", "power-of-two")


class Router(Protocol):
    now: float  # the simulated time, set before each choice

    def choose(self, adapter_id: str | None, views: list[ReplicaView]) -> str: ...


class AffinityRouter:
    def __init__(self, spread_queue: int = 4) -> None:
        self.ranker = AffinityRanker(spread_queue=spread_queue, clock=lambda: self.now)
        self.now = 0.0

    def choose(self, adapter_id: str | None, views: list[ReplicaView]) -> str:
        chosen = self.ranker.rank(adapter_id, views)[0][0]
        self.ranker.routed(adapter_id, next(v for v in views if v.replica_id == chosen))
        return chosen


class PowerOfTwoRouter:
    """Ray Serve's default: two random replicas that are not overloaded, the shorter queue; with
    ``multiplex``, tried first among the replicas that report the model, then among those with
    the fewest models, then among all."""

    def __init__(self, rng: random.Random, multiplex: bool) -> None:
        self.rng, self.multiplex, self.now = rng, multiplex, 0.0

    def choose(self, adapter_id: str | None, views: list[ReplicaView]) -> str:
        ranks = [views]
        if self.multiplex and adapter_id is not None:
            fewest = min(len(v.resident) for v in views)
            ranks = [
                [v for v in views if adapter_id in v.resident],
                [v for v in views if len(v.resident) == fewest],
                views,
            ]
        for rank in ranks:
            open_ = [v for v in rank if v.queue_len < v.max_queue]
            if open_:
                pair = self.rng.sample(open_, min(2, len(open_)))
                return min(pair, key=lambda v: v.queue_len).replica_id
        return min(views, key=lambda v: v.queue_len).replica_id


def make_router(name: str, rng: random.Random, spread_queue: int = 4) -> Router:
    """The router ``name`` (of :data:`ROUTERS`); ``spread_queue``: lora-guard's
    (``AffinityRanker``'s)."""
    if name == "lora-guard":
        return AffinityRouter(spread_queue)
    if name in ("ray-multiplex", "power-of-two"):
        return PowerOfTwoRouter(rng, multiplex=name == "ray-multiplex")
    raise ValueError(f"unknown router {name!r}; choose from {', '.join(ROUTERS)}")
