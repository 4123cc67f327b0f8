"""What a replica tells the router, and how the router reads it; imports nothing of Ray.

:func:`routing_stats` runs on the engine's loop thread (``AsyncEngine.call``) and reads the
engine's state view (``Scheduler.state``), the hot-set and cold-budget policies as they decide
from it, and the adapter loads the residency manager counted. :func:`replica_view` turns one
replica's stats, and the queue length the router knows, into the ``ReplicaView`` that
``AffinityRanker`` ranks.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from lora_guard.routing import ReplicaView

if TYPE_CHECKING:  # the router's process reads stats and never imports the engine (nor torch)
    from lora_guard.engine.llm_engine import LLMEngine

#: Seats assumed free on a replica that has not reported yet: one, so that cold requests spread
#: over fresh replicas one reserved load at a time.
UNREPORTED_FREE_SEATS = 1


def routing_stats(engine: LLMEngine) -> dict[str, Any]:
    """The replica's routing stats (call it on the engine's loop thread):

    ``resident`` adapters in the cache pool, ``pinned``, ``hot_set`` (the hot-set policy's, empty
    without it), ``free_seats`` (adapters it can load without evicting one: :func:`room`),
    ``seats`` (``max_loras``, 0: no cap), ``cold_budget_left`` (evicting loads the cold-load
    budget allows now; None without that policy: no limit) and ``retry_after_s`` (until it allows
    one, 0 when it does), ``queue`` (requests running or waiting), ``kv_bytes`` and
    ``adapter_bytes`` (the cache pool's bytes in use by each), ``loads`` (adapters loaded into the
    pool since the engine started) and ``metrics`` (the replica's Prometheus text, "" without the
    metrics plugin)."""
    from lora_guard.policies.cold_budget import ColdLoadBudget
    from lora_guard.policies.hot_set import HotSetPolicy

    state = engine.state()
    pm = engine.hooks.pm
    hot_set = pm.get_plugin("hot-set")
    budget = pm.get_plugin("cold-budget")
    metrics = pm.get_plugin("metrics")
    left: int | None = None
    retry_after = 0.0
    if isinstance(budget, ColdLoadBudget):
        left = max(budget.per_minute - len(state.evicting_loads), 0)
        retry_after = budget.retry_after(state.evicting_loads, state.now)
    resident = sorted(v.adapter_id for v in state.slots if v.adapter_id is not None)
    max_loras = int(engine.config.max_loras)
    adapter_bytes = int(state.pool_bytes.get("adapter", 0))
    free = room(
        max_loras,
        len(state.free_slots),
        len(resident),
        adapter_bytes,
        int(state.pool_bytes.get("free", 0)),
    )
    return {
        "resident": resident,
        "pinned": sorted(state.pinned),
        "hot_set": sorted(hot_set.hot_set(state)) if isinstance(hot_set, HotSetPolicy) else [],
        "free_seats": free,
        "seats": max_loras,
        "cold_budget_left": left,
        "retry_after_s": round(retry_after, 3),
        "queue": state.num_running + state.num_waiting,
        "kv_bytes": int(state.pool_bytes.get("kv", 0)),
        "adapter_bytes": adapter_bytes,
        "loads": engine.figures().loads,
        "metrics": metrics.render().decode() if metrics is not None else "",
    }


def room(
    max_loras: int, free_seats: int, resident: int, adapter_bytes: int, free_bytes: int
) -> int:
    """Adapters a replica can load without evicting one: its free seats when ``max_loras`` caps
    them; with no cap (0), as many as its free pool bytes hold at the mean size of its resident
    adapters (one when none is resident, nothing to go by: reserved loads then spread new
    adapters one at a time)."""
    if max_loras > 0:
        return free_seats
    if resident == 0 or adapter_bytes <= 0:
        return 1
    return free_bytes // max(adapter_bytes // resident, 1)


def replica_view(
    replica_id: str, stats: Mapping[str, Any], queue_len: int | None, max_queue: int
) -> ReplicaView:
    """The ranker's view of a replica from its last ``stats`` (``{}`` before its first report)
    and ``queue_len``, the router's own count of its requests (None: use the reported one)."""
    budget = stats.get("cold_budget_left")  # None: no cold-load budget, it may always load
    return ReplicaView(
        replica_id=replica_id,
        resident=frozenset(stats.get("resident", ())),
        queue_len=int(stats.get("queue", 0)) if queue_len is None else queue_len,
        max_queue=max_queue,
        free_seats=int(stats.get("free_seats", UNREPORTED_FREE_SEATS)),
        cold_budget_left=1 if budget is None else int(budget),
        loads=int(stats.get("loads", 0)),
    )


def adapter_of(model_id: str | None) -> str | None:
    """The adapter of a multiplexed model id ``tenant:adapter`` (None for the base model)."""
    if not model_id:
        return None
    return model_id.partition(":")[2] or None
