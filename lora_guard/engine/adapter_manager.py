"""Which adapter sits in which device slot, and how a request gets its adapter bound.

Three tiers: device slots (hot), host memory (warm), the adapter's folder on disk (cold). A cold
adapter is read on the loader thread; the request waits for it without holding up others.
``choose_slot`` is where adapter-load decisions are made (default: a free slot, else the least
recently used slot that no running request holds).

In merged mode (the ``on-demand`` and ``static`` baselines) there are no slots: one adapter at a
time is merged into the base weights, and a switch waits until no running request uses the
weights merged now.
"""

from __future__ import annotations

import enum
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from lora_guard.engine.lora import (
    AdapterError,
    AdapterLoader,
    HostCache,
    LoRAAdapter,
    SlotPool,
)
from lora_guard.plugins.manager import Hooks


class Lookup(str, enum.Enum):
    HOT = "hot"
    WARM = "warm"
    COLD = "cold"
    LOADING = "loading"


@dataclass(slots=True)
class Binding:
    """A request's adapter is in ``slot`` (None: merged into the base weights, or the base model);
    ``content_hash`` names the adapter's weights (None for the base model)."""

    slot: int | None
    content_hash: str | None


@dataclass(slots=True)
class SlotState:
    adapter_id: str | None = None
    content_hash: str | None = None
    refs: int = 0
    last_used: float = 0.0


@dataclass
class AdapterStats:
    lookups: dict[Lookup, int] = field(default_factory=lambda: dict.fromkeys(Lookup, 0))
    loads: int = 0
    failures: int = 0
    evictions: int = 0
    swap_ms: list[float] = field(default_factory=list)


class AdapterManager:
    def __init__(
        self,
        pool: SlotPool,
        host: HostCache,
        loader: AdapterLoader,
        registry: dict[str, Path] | None = None,
        events: Hooks | None = None,
        merge: Callable[[LoRAAdapter | None], None] | None = None,
    ) -> None:
        self.pool, self.host, self.loader, self.events = pool, host, loader, events
        self.merge = merge
        self.merged: LoRAAdapter | None = None
        self.merged_refs = 0
        self.registry: dict[str, Path] = dict(registry or {})
        self.roots: dict[str, Path | None] = {}
        self.slots = [SlotState() for _ in range(pool.num_slots)]
        self.stats = AdapterStats()
        self._load_started: dict[str, float] = {}  # disk reads under way: perf_counter at start
        self._read_ms: dict[str, float] = {}  # read from disk, not yet in a slot: the read's ms
        self._disk_reads: deque[float] = deque()  # monotonic start times, last 10 minutes
        self._waiting_cold: set[str] = set()

    # registry
    def register(self, adapter_id: str, path: Path, root: Path | None = None) -> None:
        """Add or replace an adapter; a replaced one is read again from disk on its next use.
        With ``root`` (its adapter directory), its files are read only if they resolve inside."""
        self.registry[adapter_id] = Path(path)
        self.roots[adapter_id] = root
        self.host.drop(adapter_id)
        self._read_ms.pop(adapter_id, None)
        for state in self.slots:
            if state.adapter_id == adapter_id:
                state.content_hash = None  # stale: running requests keep it, new ones reload

    def unregister(self, adapter_id: str) -> None:
        self.registry.pop(adapter_id, None)
        self.roots.pop(adapter_id, None)
        self.host.drop(adapter_id)
        self._read_ms.pop(adapter_id, None)
        for slot, state in enumerate(self.slots):
            if state.adapter_id == adapter_id and state.refs == 0:
                self._evict(slot)

    def knows(self, adapter_id: str) -> bool:
        return adapter_id in self.registry

    def slot_of(self, adapter_id: str) -> int | None:
        for slot, state in enumerate(self.slots):
            if state.adapter_id == adapter_id and state.content_hash is not None:
                return slot
        return None

    # binding
    def tier(self, adapter_id: str) -> Lookup:
        """Where ``adapter_id`` is now. Raises :class:`AdapterError` for an unknown adapter."""
        if self.slot_of(adapter_id) is not None or (
            self.merged is not None and self.merged.adapter_id == adapter_id
        ):
            return Lookup.HOT
        if adapter_id in self.loader.pending:
            return Lookup.LOADING
        if adapter_id in self.host.entries:
            return Lookup.WARM
        if adapter_id not in self.registry:
            raise AdapterError(f"adapter {adapter_id!r} is not known")
        return Lookup.COLD

    def acquire(self, adapter_id: str | None, slot: int | None = None) -> Binding | None:
        """Bind a request to ``adapter_id``; None means wait (a load is under way or no slot is
        free). A warm adapter goes into ``slot``, or the slot ``choose_slot`` picks. Raises
        :class:`AdapterError` when the adapter is unknown."""
        if self.merged_mode:
            return self._acquire_merged(adapter_id)
        assert adapter_id is not None, "base-model requests hold no slot"
        now = time.perf_counter()
        resident = self.slot_of(adapter_id)
        if resident is not None:
            self.stats.lookups[Lookup.HOT] += 1
            return self._bind(resident, now)
        adapter = self.host.get(adapter_id)
        if adapter is None:
            if self.tier(adapter_id) is Lookup.COLD:
                self._read_from_disk(adapter_id, now)
            return None
        if slot is None:
            slot = self.choose_slot()
        if slot is None or not 0 <= slot < len(self.slots) or self.slots[slot].refs:
            return None
        read_ms = self._read_ms.pop(adapter_id, None)
        tier = Lookup.COLD if read_ms is not None else Lookup.WARM
        if read_ms is None:
            self.stats.lookups[Lookup.WARM] += 1
        self._evict(slot)
        self.pool.load(slot, adapter)
        self.slots[slot] = SlotState(adapter_id, adapter.content_hash, 0, now)
        self.stats.loads += 1
        swap_ms = (read_ms or 0.0) + (time.perf_counter() - now) * 1000
        self.stats.swap_ms.append(swap_ms)
        if self.events is not None:
            self.events.notify(
                "lora_guard_adapter_loaded",
                adapter_id=adapter_id, slot=slot, tier=tier.value, swap_ms=swap_ms,
            )  # fmt: skip
        return self._bind(slot, now)

    def _read_from_disk(self, adapter_id: str, now: float) -> None:
        self.stats.lookups[Lookup.COLD] += 1
        self._load_started[adapter_id] = now
        self._disk_reads.append(time.monotonic())
        while self._disk_reads and self._disk_reads[0] < self._disk_reads[-1] - 600:
            self._disk_reads.popleft()
        self.loader.submit(adapter_id, self.registry[adapter_id], self.roots.get(adapter_id))

    def cold_loads_since(self, since: float) -> int:
        """Adapter reads from disk started after ``since`` (``time.monotonic()``)."""
        return sum(1 for t in self._disk_reads if t > since)

    @property
    def merged_mode(self) -> bool:
        return self.merge is not None

    def _acquire_merged(self, adapter_id: str | None) -> Binding | None:
        now = time.perf_counter()
        current = self.merged.adapter_id if self.merged is not None else None
        if current == adapter_id:
            if adapter_id is not None:
                self.stats.lookups[Lookup.HOT] += 1
            self.merged_refs += 1
            return Binding(None, self.merged.content_hash if self.merged else None)
        adapter = None
        if adapter_id is not None:
            adapter = self.host.get(adapter_id)
            if adapter is None:
                if self.tier(adapter_id) is Lookup.COLD:
                    self._read_from_disk(adapter_id, now)
                return None
        if self.merged_refs:
            return None  # running requests still use the weights merged now
        assert self.merge is not None
        read_ms = self._read_ms.pop(adapter_id or "", None)
        tier = Lookup.COLD if read_ms is not None else Lookup.WARM
        if adapter_id is not None and read_ms is None:
            self.stats.lookups[Lookup.WARM] += 1
        if current is not None:
            self.stats.evictions += 1
            if self.events is not None:
                self.events.notify("lora_guard_adapter_evicted", adapter_id=current, slot=-1)
        self.merge(adapter)
        self.merged = adapter
        self.merged_refs = 1
        if adapter is not None:
            swap_ms = (read_ms or 0.0) + (time.perf_counter() - now) * 1000
            self.stats.loads += 1
            self.stats.swap_ms.append(swap_ms)
            if self.events is not None:
                self.events.notify(
                    "lora_guard_adapter_loaded",
                    adapter_id=adapter.adapter_id, slot=-1, tier=tier.value, swap_ms=swap_ms,
                )  # fmt: skip
        return Binding(None, adapter.content_hash if adapter else None)

    def release(self, slot: int | None) -> None:
        if slot is None:
            self.merged_refs -= 1
            assert self.merged_refs >= 0, "merged weights released twice"
            return
        state = self.slots[slot]
        state.refs -= 1
        assert state.refs >= 0, f"slot {slot} released twice"

    def choose_slot(self) -> int | None:
        """The slot a warm adapter goes into: a free one, else the least recently used idle one."""
        idle = [s for s, state in enumerate(self.slots) if state.refs == 0]
        if not idle:
            return None
        free = [s for s in idle if self.slots[s].adapter_id is None]
        return free[0] if free else min(idle, key=lambda s: self.slots[s].last_used)

    def poll(self) -> dict[str, AdapterError]:
        """Move finished loads to the host tier; return the adapters whose load failed."""
        failed = {}
        for adapter_id, result in self.loader.collect():
            started = self._load_started.pop(adapter_id, None)
            read_ms = self.loader.read_ms.pop(adapter_id, 0.0)
            if isinstance(result, LoRAAdapter):
                if self.registry.get(adapter_id) == result.path:
                    self.host.put(result)
                    if started is not None:
                        self._read_ms[adapter_id] = read_ms
            else:
                self.stats.failures += 1
                failed[adapter_id] = result
                if self.events is not None:
                    self.events.notify(
                        "lora_guard_adapter_load_failed", adapter_id=adapter_id, error=str(result)
                    )
        return failed

    def _bind(self, slot: int, now: float) -> Binding:
        state = self.slots[slot]
        state.refs += 1
        state.last_used = now
        assert state.content_hash is not None
        return Binding(slot, state.content_hash)

    def _evict(self, slot: int) -> None:
        state = self.slots[slot]
        if state.adapter_id is not None:
            self.stats.evictions += 1
            if self.events is not None:
                self.events.notify(
                    "lora_guard_adapter_evicted", adapter_id=state.adapter_id, slot=slot
                )
        self.pool.clear(slot)
        self.slots[slot] = SlotState()

    def num_held_slots(self) -> int:
        return sum(state.refs for state in self.slots) + self.merged_refs
