"""``s3-fifo``: S3-FIFO (Yang et al., "FIFO queues are all you need for cache eviction", SOSP '23)
as an adapter eviction order on lora-guard's hooks.

Three FIFO queues: a small one (S, a tenth of the adapters' room in pages), a main one (M) and a
ghost one (G, ids only, as many as M holds). A loaded adapter enters S, or M if G remembers it.
Each adapter counts the requests that found it resident (up to 3). To free room: while S holds
more than its tenth, its oldest adapter moves to M if it was used again since it came in, else
it leaves (and G remembers it); otherwise M's oldest leaves if unused since its last pass, or
goes round again with its count less one. Sizes are in pages, as the paper's byte-sized
variant. Only adapters no running request uses may leave; the others are passed over.
"""

from __future__ import annotations

from collections import OrderedDict

from lora_guard.plugins import hookimpl
from lora_guard.plugins.state import EngineState, RequestView, SlotView
from lora_guard.policies.baselines import EvictionOrder

SMALL_SHARE = 0.1
MAX_FREQ = 3


class S3FIFOPolicy(EvictionOrder):
    def __init__(self) -> None:
        self.small: OrderedDict[str, None] = OrderedDict()  # oldest first
        self.main: OrderedDict[str, None] = OrderedDict()
        self.ghost: OrderedDict[str, None] = OrderedDict()
        self.freq: dict[str, int] = {}

    @hookimpl
    def lora_guard_adapter_lookup(self, request: RequestView, result: str) -> None:
        adapter = request.adapter_id
        if result == "hot" and adapter is not None and adapter in self.freq:
            self.freq[adapter] = min(self.freq[adapter] + 1, MAX_FREQ)

    @hookimpl
    def lora_guard_adapter_loaded(self, adapter_id: str) -> None:
        self.freq[adapter_id] = 0
        if adapter_id in self.ghost:
            del self.ghost[adapter_id]
            self.main[adapter_id] = None
        else:
            self.small[adapter_id] = None

    @hookimpl
    def lora_guard_adapter_evicted(self, adapter_id: str) -> None:
        self.freq.pop(adapter_id, None)
        if adapter_id in self.small:
            del self.small[adapter_id]
            self.ghost[adapter_id] = None
            while len(self.ghost) > max(len(self.main), 1):
                self.ghost.popitem(last=False)
        self.main.pop(adapter_id, None)

    def order(self, idle: list[SlotView], state: EngineState) -> list[SlotView]:
        by_id = {v.adapter_id: v for v in idle}
        pages = {v.adapter_id: v.pages for v in state.slots if v.adapter_id is not None}
        room = state.free_pages + sum(pages.values())
        small_pages = sum(pages.get(a, 0) for a in self.small)
        out: list[SlotView] = []
        # S first while it is over its share, then M's clock; each adapter is looked at once
        # per pass, and what it earned (a move to M, one count less) is kept.
        for adapter in list(self.small):
            if small_pages <= SMALL_SHARE * room:
                break
            if self.freq.get(adapter, 0) > 0:
                del self.small[adapter]
                self.main[adapter] = None
                self.freq[adapter] = 0
            elif adapter in by_id:
                out.append(by_id[adapter])
            small_pages -= pages.get(adapter, 0)
        for adapter in list(self.main):
            if self.freq.get(adapter, 0) > 0:
                self.freq[adapter] -= 1
                self.main.move_to_end(adapter)
            elif adapter in by_id:
                out.append(by_id[adapter])
        second = [by_id[a] for a in self.main if a in by_id]  # M's order after the pass
        rest = sorted(idle, key=lambda v: v.last_used)
        return list(dict.fromkeys([*out, *second, *rest]))
