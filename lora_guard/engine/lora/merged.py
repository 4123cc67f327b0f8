"""Merged mode, the ``on-demand`` and ``static`` baselines: no pool for adapters. One adapter at a
time is merged into the base weights, so a step serves that adapter or the base model; a switch
waits until no running request computes with the weights merged now, and there is at most one
switch a step. ``static`` merges its adapter once, for good, before serving starts.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable

from lora_guard.clock import monotonic, timer
from lora_guard.engine.lora.checkpoint import LoRAAdapter
from lora_guard.engine.lora.tiers import Lookup, Need, Residency, Sources
from lora_guard.engine.sequence import Sequence, Status
from lora_guard.plugins.decisions import Load
from lora_guard.plugins.manager import Hooks


class MergedResidency(Residency):
    merged_mode = True

    def __init__(
        self,
        merge: Callable[[LoRAAdapter | None], None],
        sources: Sources,
        max_loras: int,
        events: Hooks | None = None,
        clock: Callable[[], float] = monotonic,
    ) -> None:
        super().__init__(sources, max_loras, events, clock)
        self.merge = merge
        self.merged: LoRAAdapter | None = None
        self._switched = False  # a switch happened in the step being formed

    def merge_for_good(self, adapter: LoRAAdapter) -> None:
        """The static baseline: ``adapter`` merged before serving starts, never switched."""
        self.host.put(adapter)
        self._switch(adapter, evicts=False)

    def reread_if_changed(self, adapter_id: str) -> bool:
        return False  # merged weights stay what they were merged from

    def resident_adapters(self) -> tuple[str, ...]:
        return (self.merged.adapter_id,) if self.merged is not None else ()

    def _current(self) -> tuple[str | None, str | None]:
        merged = self.merged
        return (merged.adapter_id, merged.content_hash) if merged is not None else (None, None)

    def is_hot(self, adapter_id: str | None) -> bool:
        return self._current()[0] == adapter_id

    def need(self, seq: Sequence) -> Need:
        """Every request needs weights here: its adapter merged, or the base weights unmerged."""
        started_under = seq.adapter_hash if seq.status is Status.RUNNING else None
        adapter_id, content_hash = self._current()
        ready = adapter_id == seq.adapter_id and started_under in (None, content_hash)
        return Need(seq.adapter_id, started_under, ready, content_hash if ready else None)

    def load_evicts(self, need: Need) -> bool:
        return self._where(need.adapter_id) is Lookup.WARM and self.merged is not None

    def begin_step(
        self, demand: Counter[str], bound: Counter[tuple[str | None, str | None]]
    ) -> None:
        super().begin_step(demand, bound)
        self._switched = False

    def bring_in(self, need: Need, how: Load, holders: Iterable[Sequence], parked: bool) -> bool:
        """Merge ``need``'s adapter (unmerge, for the base weights) once no running request
        computes with the weights merged now."""
        if need.ready:
            return True
        adapter = None
        if need.adapter_id is not None:
            adapter = self._host_or_read(need.adapter_id)
            if adapter is None:
                return False
        if self._switched or self.bound[self._current()]:
            return False  # running requests still compute with the weights merged now
        self._switch(adapter, evicts=not parked and self.load_evicts(need))
        return True

    def _switch(self, adapter: LoRAAdapter | None, *, evicts: bool) -> None:
        started = timer()
        if self.merged is not None:
            self._evicted(self.merged.adapter_id, -1)
        self.merge(adapter)
        self.merged, self._switched = adapter, True
        if adapter is not None:
            self._loaded(adapter.adapter_id, -1, started)
            if evicts:
                self.usage.evicting_loads.add(adapter.adapter_id)
