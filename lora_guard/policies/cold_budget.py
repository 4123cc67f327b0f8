"""Cold-load budget: at most ``cold_loads_per_minute`` adapter reads from disk in any 60 s.

A request that needs one more is rejected with ``BusyRetry``, its retry-after the time until the
oldest load in the window leaves it. Above ``high_watermark`` (share of the KV pool in use) new
cold loads wait; evicting a resident adapter to make room happens only below ``low_watermark``.
Reads run on the engine's loader thread, never in the step.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from lora_guard.plugins import Defer, Reject, hookimpl
from lora_guard.plugins.decisions import AdapterDecision
from lora_guard.plugins.options import OptionRegistry
from lora_guard.plugins.state import EngineState, RequestView

WINDOW_S = 60.0
MIN_RETRY_AFTER_S = 0.05


class ColdLoadBudget:
    def __init__(self) -> None:
        self.per_minute = 6
        self.low_watermark = 0.82
        self.high_watermark = 0.95
        self.loads: deque[float] = deque()

    @hookimpl
    def lora_guard_add_options(self, options: OptionRegistry) -> None:
        options.add("cold_loads_per_minute", int, 6, "adapter loads from disk allowed per minute")
        options.add(
            "low_watermark",
            float,
            0.82,
            "evict resident adapters only while KV memory use is below this share",
        )
        options.add("high_watermark", float, 0.95,
                    "above this share of KV memory in use, new cold loads wait")  # fmt: skip

    @hookimpl
    def lora_guard_configure(self, config: dict[str, Any]) -> None:
        self.per_minute = int(config.get("cold_loads_per_minute", 6))
        self.low_watermark = float(config.get("low_watermark", 0.82))
        self.high_watermark = float(config.get("high_watermark", 0.95))
        if self.per_minute < 1:
            raise ValueError("cold_loads_per_minute must be at least 1")
        if not 0 < self.low_watermark <= self.high_watermark <= 1:
            raise ValueError("watermarks must satisfy 0 < low_watermark <= high_watermark <= 1")

    def retry_after(self, now: float) -> float:
        """Seconds until the window has room again."""
        self._forget(now)
        if len(self.loads) < self.per_minute:
            return 0.0
        return max(self.loads[0] + WINDOW_S - now, MIN_RETRY_AFTER_S)

    @hookimpl(tryfirst=True)
    def lora_guard_adapter_load(
        self, request: RequestView, tier: str, state: EngineState
    ) -> AdapterDecision | None:
        if tier == "cold":
            if state.memory_watermark > self.high_watermark:
                return Defer("memory above the high watermark")
            wait = self.retry_after(state.now)
            if wait > 0:
                return Reject(
                    f"adapter {request.adapter_id!r} is cold and the cold-load budget "
                    f"({self.per_minute} per minute) is spent",
                    wait,
                )
            self.loads.append(state.now)
            return None
        if not state.free_slots and state.memory_watermark >= self.low_watermark:
            return Defer("memory above the low watermark: no eviction now")
        return None

    def _forget(self, now: float) -> None:
        while self.loads and self.loads[0] <= now - WINDOW_S:
            self.loads.popleft()
