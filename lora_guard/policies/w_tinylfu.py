"""``w-tinylfu``: W-TinyLFU (Einziger, Friedman and Manes, "TinyLFU: a highly efficient cache
admission policy", ACM ToS 2017; Caffeine's eviction policy) as an adapter eviction order on
lora-guard's hooks.

Every request counts in a frequency sketch (count-min, 4 rows; every count halves after ten
requests per adapter the pool holds, so old popularity fades). A loaded adapter enters a window
(1% of the adapters' room in pages, at least one adapter); the rest of the pool is a segmented
LRU, probation and protected (80%). A request that finds its adapter in probation moves it to
protected. To free room, the window's least recent adapter, once the window is over its size,
duels with probation's least recent: the one the sketch counts less often leaves (a tie: the
newcomer), as TinyLFU admits a candidate only if it is more popular than the victim. Adapters
cannot be bypassed (a request needs its adapter in the pool), so a refused newcomer leaves
first instead. Only adapters no running request uses may leave.
"""

from __future__ import annotations

import zlib
from collections import OrderedDict

from lora_guard.plugins import hookimpl
from lora_guard.plugins.state import EngineState, RequestView, SlotView
from lora_guard.policies.baselines import EvictionOrder

WINDOW_SHARE = 0.01
PROTECTED_SHARE = 0.8
ROWS, WIDTH = 4, 1024
SAMPLES_PER_ENTRY = 10


class FrequencySketch:
    """A count-min sketch with periodic halving (TinyLFU's reset)."""

    def __init__(self) -> None:
        self.table = [[0] * WIDTH for _ in range(ROWS)]
        self.additions = 0

    def _cells(self, key: str) -> list[int]:
        return [zlib.crc32(f"{row}:{key}".encode()) % WIDTH for row in range(ROWS)]

    def add(self, key: str, reset_after: int) -> None:
        for row, cell in enumerate(self._cells(key)):
            self.table[row][cell] += 1
        self.additions += 1
        if self.additions >= reset_after:
            self.table = [[count // 2 for count in row] for row in self.table]
            self.additions //= 2

    def estimate(self, key: str) -> int:
        return min(self.table[row][cell] for row, cell in enumerate(self._cells(key)))


class WTinyLFUPolicy(EvictionOrder):
    def __init__(self) -> None:
        self.sketch = FrequencySketch()
        self.window: OrderedDict[str, None] = OrderedDict()  # least recent first
        self.probation: OrderedDict[str, None] = OrderedDict()
        self.protected: OrderedDict[str, None] = OrderedDict()
        self.resident = 1

    @hookimpl
    def lora_guard_adapter_lookup(self, request: RequestView, result: str) -> None:
        adapter = request.adapter_id
        if adapter is None:
            return
        self.sketch.add(adapter, SAMPLES_PER_ENTRY * max(self.resident, 1))
        if result != "hot":
            return
        if adapter in self.window:
            self.window.move_to_end(adapter)
        elif adapter in self.protected:
            self.protected.move_to_end(adapter)
        elif adapter in self.probation:
            del self.probation[adapter]
            self.protected[adapter] = None

    @hookimpl
    def lora_guard_adapter_loaded(self, adapter_id: str) -> None:
        self.window[adapter_id] = None

    @hookimpl
    def lora_guard_adapter_evicted(self, adapter_id: str) -> None:
        for segment in (self.window, self.probation, self.protected):
            segment.pop(adapter_id, None)

    def order(self, idle: list[SlotView], state: EngineState) -> list[SlotView]:
        pages = {v.adapter_id: v.pages for v in state.slots if v.adapter_id is not None}
        self.resident = len(pages)
        room = state.free_pages + sum(pages.values())
        self._rebalance(pages, room)
        by_id = {v.adapter_id: v for v in idle}
        window_pages = sum(pages.get(a, 0) for a in self.window)
        for adapter in [a for a in self.window if a not in by_id]:
            if window_pages <= max(WINDOW_SHARE * room, 1):
                break
            del self.window[adapter]  # in use: admitted, as it cannot be the one to leave
            self.probation[adapter] = None
            window_pages -= pages.get(adapter, 0)
        window = [a for a in self.window if a in by_id]
        probation = [a for a in self.probation if a in by_id]
        out: list[str] = []
        while window or probation:
            if window and (window_pages > max(WINDOW_SHARE * room, 1) or not probation):
                candidate = window[0]
                victim = probation[0] if probation else None
                if victim is None or self.sketch.estimate(candidate) <= self.sketch.estimate(
                    victim
                ):
                    out.append(window.pop(0))  # not admitted: the newcomer leaves
                else:
                    out.append(probation.pop(0))  # admitted over probation's least recent
                    window.pop(0)  # ... and moves to probation, behind the others
                    probation.append(candidate)
                    del self.window[candidate]
                    self.probation[candidate] = None
                window_pages -= pages.get(candidate, 0)
            else:
                out.append(probation.pop(0))
        protected = [a for a in self.protected if a in by_id]
        rest = sorted(idle, key=lambda v: v.last_used)
        return list(dict.fromkeys([*(by_id[a] for a in out + protected), *rest]))

    def _rebalance(self, pages: dict[str, int], room: int) -> None:
        """Protected over its share: its least recent adapters go back to probation."""
        protected_pages = sum(pages.get(a, 0) for a in self.protected)
        while self.protected and protected_pages > PROTECTED_SHARE * room:
            adapter, _ = self.protected.popitem(last=False)
            self.probation[adapter] = None
            protected_pages -= pages.get(adapter, 0)
