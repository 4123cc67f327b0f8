"""What the scheduler asks of adapter residency, and the tiers every residency shares.

An adapter is hot (its weights are where a step computes with them), warm (read into host memory),
loading (being read on the loader thread) or cold (only its folder on disk). ``Residency`` keeps
the registry, the host tier and the disk reads, and answers where an adapter is; what hot means is
its subclasses': ``ResidencyManager`` (``residency.py``) pages adapters into the pool beside the KV,
``MergedResidency`` (``merged.py``) merges one adapter at a time into the base weights.

The scheduler speaks to either through the same questions, step by step: ``begin_step``, ``need``
(where a request's weights stand), ``bring_in`` (make them ready), ``use`` (a step computes with
them), ``evict_for_kv``, ``end_step``.
"""

from __future__ import annotations

import enum
import logging
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from lora_guard.clock import monotonic, timer
from lora_guard.engine.cost_meter import CostMeter
from lora_guard.engine.lora.checkpoint import AdapterError, LoRAAdapter, files_stamp
from lora_guard.engine.lora.loader import AdapterLoader, HostCache
from lora_guard.engine.lora.registry import AdapterEntry, AdapterRegistry
from lora_guard.engine.sequence import Sequence
from lora_guard.engine.usage import AdapterUsage
from lora_guard.plugins.decisions import Load
from lora_guard.plugins.manager import Hooks
from lora_guard.plugins.state import SlotView

if TYPE_CHECKING:
    from lora_guard.engine.lora.seats import Resident

log = logging.getLogger(__name__)


class Lookup(str, enum.Enum):
    HOT = "hot"
    WARM = "warm"
    COLD = "cold"
    LOADING = "loading"


@dataclass
class AdapterStats:
    lookups: dict[Lookup, int] = field(default_factory=lambda: dict.fromkeys(Lookup, 0))
    loads: int = 0
    failures: int = 0
    evictions: int = 0
    changed_on_disk: int = 0  # adapters read again because their files changed
    peak_resident: int = 0  # the most adapters resident at once
    swap_ms: list[float] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class Need:
    """Where a request's weights stand, seen from that request (:meth:`Residency.need`): the
    adapter (None: the base weights, in merged mode), the version a running request computes
    with, whether they are ready for a step, the version it computes with when they are, and the
    pool's weights the step computes with (paged residency only)."""

    adapter_id: str | None
    started_under: str | None
    ready: bool
    content_hash: str | None = None
    resident: Resident | None = None


@dataclass(frozen=True)
class Sources:
    """Where adapters' weights come from: the registry (ids to folders), host memory (the warm
    tier) and the loader thread that reads folders (the cold one)."""

    registry: AdapterRegistry
    host: HostCache
    loader: AdapterLoader


class Residency:
    """The registry, the host tier and the disk reads, and the questions the scheduler asks."""

    merged_mode = False  # whether the weights themselves change (for reports)

    def __init__(
        self,
        sources: Sources,
        max_loras: int,
        events: Hooks | None = None,
        clock: Callable[[], float] = monotonic,
    ) -> None:
        self.host, self.loader = sources.host, sources.loader
        self.registry, self.events, self.clock = sources.registry, events, clock
        self.max_loras = max_loras  # 0: no seat cap
        self.seats: list[Resident | None] = []
        self.usage = AdapterUsage(max_loras, clock=clock)  # pins, heat and recent loads
        self.stats = AdapterStats()
        self.costs = CostMeter()  # what the engine's steps say a page costs to bring back
        self.demand: Counter[str] = Counter()  # requests (running or waiting) per adapter
        # running requests per version, (adapter id, content hash); (None, None): base weights
        self.bound: Counter[tuple[str | None, str | None]] = Counter()
        self.short_of_pages = False  # a load waits for pages that KV in use holds
        self._load_started: dict[str, float] = {}  # disk reads under way: the stopwatch at start
        self._read_ms: dict[str, float] = {}  # read from disk, not yet resident: the read's ms
        self._stamps: dict[str, tuple[int, ...] | None] = {}  # files as last read (files_stamp)

    # registry
    def register(self, adapter_id: str, path: Path, root: Path | None = None) -> None:
        """Add or replace an adapter; a replaced one is read again from disk on its next use,
        while requests that started under the old weights finish under them."""
        self.registry.add(adapter_id, path, root)
        self._forget(adapter_id)

    def arrived(self, seq: Sequence) -> bool:
        """A request for ``seq.adapter_id`` arrived: count its heat, and read the adapter again
        if its files changed on disk (:meth:`reread_if_changed`). True when they had."""
        assert seq.adapter_id is not None
        self.usage.arrived(seq.tenant_id, seq.adapter_id)
        return self.reread_if_changed(seq.adapter_id)

    def reread_if_changed(self, adapter_id: str) -> bool:
        """If ``adapter_id``'s files changed on disk since they were read, replace it as
        :meth:`register` does (new requests get the new weights; running ones finish under the
        old). True when they had changed."""
        entry = self._registration(adapter_id)
        if entry is None or adapter_id not in self._stamps:
            return False
        if files_stamp(entry.path) == self._stamps[adapter_id]:
            return False
        self.register(adapter_id, entry.path, entry.root)
        self.stats.changed_on_disk += 1
        log.info("adapter %r changed on disk: read again for new requests", adapter_id)
        return True

    def unregister(self, adapter_id: str) -> None:
        self.registry.remove(adapter_id)
        self._forget(adapter_id)

    def _forget(self, adapter_id: str) -> None:
        """Drop what was read of ``adapter_id``: its next use reads it again."""
        self.host.drop(adapter_id)
        self._read_ms.pop(adapter_id, None)
        self._stamps.pop(adapter_id, None)

    def knows(self, adapter_id: str) -> bool:
        return self._registration(adapter_id) is not None

    def _registration(self, adapter_id: str) -> AdapterEntry | None:
        """Where ``adapter_id``'s files are (the one place residency asks the registry)."""
        return self.registry.get(adapter_id)

    # lookups
    def residents(self) -> list[Resident]:
        """The adapters in the pool's seats (none in merged mode)."""
        return [entry for entry in self.seats if entry is not None]

    def resident_adapters(self) -> tuple[str, ...]:
        """The adapters whose current weights a step can compute with now."""
        return tuple(e.adapter_id for e in self.residents() if not e.stale)

    def tier(self, adapter_id: str | None) -> Lookup:
        """Where ``adapter_id``'s current weights are (None: the base weights). Raises
        :class:`AdapterError` for an unknown adapter."""
        where = self._where(adapter_id)
        if where is None:
            raise AdapterError(f"adapter {adapter_id!r} is not known")
        return where

    def lookup(self, need: Need) -> Lookup:
        """Where ``need``'s current weights are (:meth:`tier`)."""
        return self.tier(need.adapter_id)

    def _where(self, adapter_id: str | None) -> Lookup | None:
        if self.is_hot(adapter_id):
            return Lookup.HOT
        if adapter_id is None:
            return Lookup.WARM  # the base weights are always at hand
        if adapter_id in self.loader.pending:
            return Lookup.LOADING
        if adapter_id in self.host.entries:
            return Lookup.WARM
        if self._registration(adapter_id) is None:
            return None
        return Lookup.COLD

    def pages_by_adapter(self, adapter_ids: Iterable[str]) -> dict[str, int]:
        """Pages each resident adapter, and each of ``adapter_ids`` in host memory, takes in the
        pool (none in merged mode)."""
        return {}

    def ranks(self) -> dict[str, int]:
        """The largest rank of each adapter in host memory or in the pool."""
        return {a: adapter.rank for a, adapter in self.host.entries.items()}

    def slot_views(self, running: Counter[str], now: float) -> tuple[SlotView, ...]:
        """The pool's seats as the policies see them, with the running requests per adapter."""
        return ()

    # the step
    def begin_step(
        self, demand: Counter[str], bound: Counter[tuple[str | None, str | None]]
    ) -> None:
        """A new step is being formed: no request uses any weights yet."""
        self.demand, self.bound = demand, bound
        self.short_of_pages = False

    def end_step(self) -> None:
        """The step ran: no request computes with any weights until the next one is formed."""

    # what each residency answers its own way
    def is_hot(self, adapter_id: str | None) -> bool:
        """Whether a step can compute with ``adapter_id``'s current weights now."""
        raise NotImplementedError

    def need(self, seq: Sequence) -> Need | None:
        """Where ``seq``'s weights stand for ``seq``; None when it waits for none."""
        raise NotImplementedError

    def load_evicts(self, need: Need) -> bool:
        """Whether bringing ``need``'s current weights in now evicts weights that requests still
        need (thrash)."""
        raise NotImplementedError

    def version_gone(self, need: Need) -> bool:
        """Whether ``need``'s request started under weights that are neither at hand nor
        current: it must start again."""
        return False

    def bring_in(self, need: Need, how: Load, holders: Iterable[Sequence], parked: bool) -> bool:
        """Make ``need``'s weights ready (in ``how.slot``, evicting the seats ``how.evict`` names
        when pages are short, where the residency has seats); False means wait. ``holders`` are
        the sequences that hold KV blocks; ``parked``: for running requests that wait. Raises
        :class:`AdapterError` when the adapter is unknown or can never fit."""
        raise NotImplementedError

    def use(self, need: Need) -> None:
        """The step being formed computes with ``need``'s weights."""

    def evict_for_kv(self, keep: Resident | None) -> bool:
        """Give an adapter's pages to KV in use; False when none can go."""
        return False

    def make_room(
        self, pages: int, keep: Resident | None = None, protect: Iterable[int] = ()
    ) -> None:
        """Empty ``pages`` pages for KV if it can, by the pool's eviction choice over cached
        prefix blocks and idle adapters (``plugins/eviction.py``); ``protect``: blocks the
        asking request reuses. Without adapter pages, free cached blocks are reused least
        recently used first, as they come."""

    # disk
    def _read_from_disk(self, adapter_id: str) -> None:
        self._load_started[adapter_id] = timer()
        self.usage.disk_reads.add(adapter_id)
        entry = self._registration(adapter_id)
        assert entry is not None
        self.loader.submit(adapter_id, entry.path, entry.root)

    def _host_or_read(self, adapter_id: str) -> LoRAAdapter | None:
        """``adapter_id``'s weights from host memory; None while they are read (the read is
        started now if it was cold)."""
        adapter = self.host.get(adapter_id)
        if adapter is None and self.tier(adapter_id) is Lookup.COLD:
            self._read_from_disk(adapter_id)
        return adapter

    def poll(self) -> dict[str, AdapterError]:
        """Move finished reads to the host tier; return the adapters whose read failed."""
        failed = {}
        for adapter_id, result in self.loader.collect():
            started = self._load_started.pop(adapter_id, None)
            read_ms = self.loader.read_ms.pop(adapter_id, 0.0)
            if isinstance(result, LoRAAdapter):
                entry = self._registration(adapter_id)
                if entry is not None and entry.path == result.path:
                    self.host.put(result)
                    self._stamps[adapter_id] = result.stamp
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

    def _loaded(self, adapter_id: str, seat: int, started: float) -> None:
        read_ms = self._read_ms.pop(adapter_id, None)
        tier = Lookup.COLD if read_ms is not None else Lookup.WARM
        swap_ms = (read_ms or 0.0) + (timer() - started) * 1000
        self.stats.loads += 1
        self.stats.swap_ms.append(swap_ms)
        if self.events is not None:
            self.events.notify(
                "lora_guard_adapter_loaded",
                adapter_id=adapter_id,
                slot=seat,
                tier=tier.value,
                swap_ms=swap_ms,
                read_ms=read_ms or 0.0,
            )

    def _evicted(self, adapter_id: str, seat: int) -> None:
        self.stats.evictions += 1
        if self.events is not None:
            self.events.notify("lora_guard_adapter_evicted", adapter_id=adapter_id, slot=seat)
