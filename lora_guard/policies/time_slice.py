"""``time-slice``: LoRAX's adapter exchange (``router/src/scheduler.rs``, ``AdapterQueuesState``)
on lora-guard's hooks.

Requests wait in one queue per adapter. At most as many adapters as the pool holds now (the
seats with ``max_loras``) are active, and only active adapters' requests are offered a place.
Every ``SLICE_S`` (2 s, LoRAX's ``adapter_cycle_time_s``), if adapters with waiting requests are
inactive, the adapters active longest give their turn to them, oldest waiting request first;
an inactive adapter leaves the pool before an active one (least recently used first among each).
"""

from __future__ import annotations

from collections.abc import Sequence

from lora_guard.plugins import hookimpl
from lora_guard.plugins.state import EngineState, RequestView, SlotView
from lora_guard.policies.baselines import EvictionOrder

SLICE_S = 2.0


class TimeSlicePolicy(EvictionOrder):
    def __init__(self) -> None:
        self.active: dict[str, float] = {}  # adapter -> when its turn began

    def order(self, idle: list[SlotView], state: EngineState) -> list[SlotView]:
        return sorted(idle, key=lambda v: (v.adapter_id in self.active, v.last_used))

    @hookimpl
    def lora_guard_batch_form(
        self, waiting: Sequence[RequestView], running: Sequence[RequestView], state: EngineState
    ) -> list[str]:
        oldest: dict[str, float] = {}
        for r in waiting:
            if r.adapter_id is not None:
                oldest.setdefault(r.adapter_id, r.arrival_time)
        busy = {r.adapter_id for r in running} | set(oldest)
        self.active = {a: t for a, t in self.active.items() if a in busy}
        turns = max(1, sum(v.adapter_id is not None for v in state.slots))
        queued = sorted((a for a in oldest if a not in self.active), key=oldest.__getitem__)
        for adapter in queued:
            if len(self.active) >= turns:
                longest = min(self.active, key=self.active.__getitem__)
                if state.now - self.active[longest] < SLICE_S:
                    break
                del self.active[longest]
            self.active[adapter] = state.now
        return [
            r.request_id for r in waiting if r.adapter_id is None or r.adapter_id in self.active
        ]
