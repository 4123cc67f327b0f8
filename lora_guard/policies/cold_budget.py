"""Cold-load budget: at most ``cold_loads_per_minute`` adapter loads that evict an adapter that
requests still need (thrash) in any 60 s. Loads into free memory, or into the room of adapters no
request needs, are free.

A request whose load would go over the budget waits in an ordered queue: when the window has room,
the request that has waited longest loads first. After ``cold_queue_timeout`` seconds in the queue
it is rejected with ``BusyRetry``, its retry-after the time until the window has room for it (its
place in the queue counted). A running request whose adapter left the pool (parked) is never
held here: the engine's residency quantum paces those. Above ``high_watermark`` (share of the
cache pool in use) new reads from disk wait; evicting loads wait while the KV blocks in use hold
more than ``low_watermark`` of the pool.

The engine keeps the window of evicting loads (``EngineState.evicting_loads``); this policy reads
it and decides.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from lora_guard.plugins import Defer, Reject, hookimpl
from lora_guard.plugins.decisions import AdapterDecision
from lora_guard.plugins.options import OptionRegistry
from lora_guard.plugins.state import LOAD_WINDOW_S as WINDOW_S  # the budget is per minute
from lora_guard.plugins.state import EngineState, RequestView

MIN_RETRY_AFTER_S = 0.05


class ColdLoadBudget:
    def __init__(self) -> None:
        self.per_minute = 6
        self.low_watermark = 0.82
        self.high_watermark = 0.95
        self.queue_timeout_s = 10.0
        self.queue: OrderedDict[str, float] = OrderedDict()  # request id -> when it queued

    @hookimpl
    def lora_guard_add_options(self, options: OptionRegistry) -> None:
        options.add(
            "cold_loads_per_minute",
            int,
            6,
            "adapter loads that evict an adapter requests still need, allowed per minute",
        )
        options.add(
            "cold_queue_timeout",
            float,
            10.0,
            "seconds a request waits in the ordered queue for the budget before it gets 429",
        )
        options.add(
            "low_watermark",
            float,
            0.82,
            "evicting loads wait while KV blocks in use hold more than this share of the pool",
        )
        options.add(
            "high_watermark",
            float,
            0.95,
            "above this share of the cache pool in use, new reads from disk wait",
        )

    @hookimpl
    def lora_guard_configure(self, config: dict[str, Any]) -> None:
        self.per_minute = int(config.get("cold_loads_per_minute", 6))
        self.queue_timeout_s = float(config.get("cold_queue_timeout", 10.0))
        self.low_watermark = float(config.get("low_watermark", 0.82))
        self.high_watermark = float(config.get("high_watermark", 0.95))
        if self.per_minute < 1:
            raise ValueError("cold_loads_per_minute must be at least 1")
        if self.queue_timeout_s < 0:
            raise ValueError("cold_queue_timeout must be at least 0")
        if not 0 < self.low_watermark <= self.high_watermark <= 1:
            raise ValueError("watermarks must satisfy 0 < low_watermark <= high_watermark <= 1")

    def retry_after(self, loads: Sequence[float], now: float, place: int = 0) -> float:
        """Seconds until the window of ``loads`` (their times, oldest first) has room for the
        load at ``place`` in the queue (0: next)."""
        # Load k of the sequence (the window's, then the queue's) goes a window after load
        # k - per_minute; a queued load with fewer than per_minute before it goes now.
        k, windows = len(loads) + place, 0
        if k < self.per_minute:
            return 0.0
        while k >= self.per_minute and k >= len(loads):
            k, windows = k - self.per_minute, windows + 1
        start = loads[k] if k < len(loads) else now
        return max(start + WINDOW_S * windows - now, MIN_RETRY_AFTER_S)

    @hookimpl(tryfirst=True)
    def lora_guard_adapter_load(
        self, request: RequestView, tier: str, state: EngineState, parked: bool, evicts: bool
    ) -> AdapterDecision | None:
        if parked:
            return None
        if tier == "cold":
            if state.memory_watermark > self.high_watermark:
                return Defer("memory above the high watermark")
            return None  # a read into host memory evicts nothing
        if not evicts:
            self.queue.pop(request.request_id, None)
            return None
        if state.kv_share > self.low_watermark:
            return Defer("KV use above the low watermark: no eviction now")
        now = state.now
        queued_at = self.queue.setdefault(request.request_id, now)
        place = list(self.queue).index(request.request_id)
        wait = self.retry_after(state.evicting_loads, now, place)
        if wait == 0:
            del self.queue[request.request_id]
            return None  # the engine counts the load once it is made
        if now - queued_at >= self.queue_timeout_s:
            del self.queue[request.request_id]
            return Reject(
                f"adapter {request.adapter_id!r} is not resident and the cold-load budget "
                f"({self.per_minute} evicting loads per minute) is spent",
                max(wait, MIN_RETRY_AFTER_S),
            )
        return Defer("cold-load budget spent: waiting in order")

    @hookimpl
    def lora_guard_request_finished(self, request: RequestView) -> None:
        self.queue.pop(request.request_id, None)
