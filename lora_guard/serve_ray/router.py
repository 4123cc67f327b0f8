"""The adapter-affinity request router of Ray Serve (``ray.serve.request_router``).

For each request it reads the adapter from the multiplexed model id (``tenant:adapter``), builds
each replica's ``ReplicaView`` from the routing stats the replica last reported and from the
router's own count of the requests it sent there, and asks ``AffinityRanker`` for the order.
It returns one replica per rank, best first: Ray Serve sends the request to the first that has
room under ``max_ongoing_requests``. The load the first choice will make is reserved at once, so
that a concurrent cold request for the same adapter follows it rather than loading it twice.
"""

from __future__ import annotations

from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from lora_guard.routing import AffinityRanker, ReplicaView
from lora_guard.serve_ray.stats import adapter_of, replica_view


class AdapterAffinityRouter(RequestRouter):  # type: ignore[misc]
    """``request_router_kwargs``: ``spread_queue`` and ``reservation_s`` of ``AffinityRanker``."""

    ranker: AffinityRanker

    def initialize_state(self, spread_queue: int = 4, reservation_s: float = 10.0) -> None:
        self.ranker = AffinityRanker(spread_queue=spread_queue, reservation_s=reservation_s)

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        model_id = pending_request.metadata.multiplexed_model_id if pending_request else None
        adapter_id = adapter_of(model_id)
        views = {self._key(r.replica_id): self._view(r) for r in candidate_replicas}
        replicas = {self._key(r.replica_id): r for r in candidate_replicas}
        order = [rid for tier in self.ranker.rank(adapter_id, list(views.values())) for rid in tier]
        if order:
            self.ranker.routed(adapter_id, views[order[0]])
        return [[replicas[rid]] for rid in order]

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any
    ) -> None:
        """Where the request went in the end (the first choice may have been full)."""
        replica = self.curr_replicas.get(replica_id)
        if replica is not None:
            adapter_id = adapter_of(pending_request.metadata.multiplexed_model_id)
            self.ranker.routed(adapter_id, self._view(replica))

    def _view(self, replica: RunningReplica) -> ReplicaView:
        stats = replica.routing_stats or {}
        queue_len = self.replica_queue_len_cache.get(replica.replica_id)
        return replica_view(
            self._key(replica.replica_id), stats, queue_len, replica.max_ongoing_requests
        )

    @staticmethod
    def _key(replica_id: ReplicaID) -> str:
        return str(replica_id.unique_id)
