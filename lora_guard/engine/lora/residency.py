"""Which adapters are resident in the pool, decided step by step.

Three tiers: the pool (hot), host memory (warm), the adapter's folder on disk (cold). A cold
adapter is read on the loader thread; the requests that need it wait without holding up others.

Residency is per step: a request uses its adapter only while it is in a step's batch (``use``),
so between two steps any resident adapter may leave, and the running requests that need it wait,
parked with their KV kept, until it comes back. What keeps this from thrashing is the residency
quantum: an adapter that running or waiting requests still need stays at least
``quantum_s`` after its load. The pool's free pages cap the adapters' bytes; ``max_loras``
seats, when set, also cap how many are resident at once (0, the default: no cap, a free seat
is always there and the pages alone decide, as in S-LoRA's unified paging).

In merged mode (the ``on-demand`` and ``static`` baselines) there is no pool: one adapter at a
time is merged into the base weights, and a switch waits until no running request uses the
weights merged now.
"""

from __future__ import annotations

import enum
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from lora_guard.engine.kv_cache import BlockManager
from lora_guard.engine.lora.checkpoint import AdapterError, LoRAAdapter, files_stamp
from lora_guard.engine.lora.compute import kernel_plan
from lora_guard.engine.lora.loader import AdapterLoader, HostCache
from lora_guard.engine.lora.pool import AdapterLayout, CachePool, LayerWeights
from lora_guard.engine.lora.registry import AdapterEntry, AdapterRegistry
from lora_guard.engine.sequence import Sequence, Status
from lora_guard.engine.usage import AdapterUsage
from lora_guard.plugins.manager import Hooks
from lora_guard.policies.victims import ResidentView, eviction_order, kv_order, may_leave

log = logging.getLogger(__name__)


class Lookup(str, enum.Enum):
    HOT = "hot"
    WARM = "warm"
    COLD = "cold"
    LOADING = "loading"


@dataclass(eq=False)
class Resident:
    """One version of an adapter in the pool: pages ``[first_page, first_page + num_pages)``."""

    adapter_id: str
    content_hash: str
    seat: int
    first_page: int
    layout: AdapterLayout
    layers: list[LayerWeights]
    loaded_at: float
    last_used: float
    in_step: int = 0  # requests of the step being formed that compute with it
    stale: bool = False  # replaced on disk: serves only the requests that started under it
    _plan: tuple[list[LayerWeights], torch.Tensor] | None = field(default=None, repr=False)

    @property
    def num_pages(self) -> int:
        return self.layout.num_pages

    @property
    def plan(self) -> torch.Tensor:
        """Where ``layers`` sit in the pool, for the LoRA kernel; made again when they move."""
        if self._plan is None or self._plan[0] is not self.layers:
            self._plan = (self.layers, kernel_plan(self.layers))
        return self._plan[1]


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
    """Where a request's adapter stands, seen from that request (:meth:`ResidencyManager.need`):
    the adapter, the version a running request computes with, and the weights it computes with
    when they are in the pool. What else the scheduler asks of it (``tier``, ``load_evicts``,
    ``version_gone``) it asks the residency manager, from the pool as it is then."""

    adapter_id: str
    started_under: str | None  # the version a running request computes with
    resident: Resident | None  # the weights it computes with, when they are in the pool


@dataclass(slots=True)
class Binding:
    """Merged mode: the request computes with the merged weights named ``content_hash``."""

    content_hash: str | None


class ResidencyManager:
    def __init__(
        self,
        pool: CachePool | None,
        blocks: BlockManager,
        host: HostCache,
        loader: AdapterLoader,
        registry: AdapterRegistry,
        max_loras: int,
        quantum_s: float = 1.0,
        events: Hooks | None = None,
        merge: Callable[[LoRAAdapter | None], None] | None = None,
    ) -> None:
        self.pool, self.blocks, self.host, self.loader = pool, blocks, host, loader
        self.registry, self.events, self.merge = registry, events, merge
        self.quantum_s = quantum_s
        self.max_loras = max_loras  # 0: no seat cap
        self.seats: list[Resident | None] = [None] * (0 if merge else max(max_loras, 1))
        self.usage = AdapterUsage(max_loras)  # pins, heat and recent loads
        self.top = 0  # pages [0, top) hold adapters
        self.stats = AdapterStats()
        self.demand: Counter[str] = Counter()  # requests (running or waiting) per adapter
        self.bound: Counter[tuple[str, str]] = Counter()  # running requests per version
        self.short_of_pages = False
        self.merged: LoRAAdapter | None = None
        self.merged_refs = 0
        self._layouts: dict[str, AdapterLayout] = {}  # by content hash
        self._load_started: dict[str, float] = {}  # disk reads under way: perf_counter at start
        self._read_ms: dict[str, float] = {}  # read from disk, not yet resident: the read's ms
        self._stamps: dict[str, tuple[int, ...] | None] = {}  # files as last read (files_stamp)

    @property
    def merged_mode(self) -> bool:
        return self.merge is not None

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
        old). True when they had changed. Merged mode (the baselines) keeps what it merged."""
        entry = self._registration(adapter_id)
        if self.merge is not None or entry is None or adapter_id not in self._stamps:
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
        self._drop_unused_stale()

    def _forget(self, adapter_id: str) -> None:
        """Drop what was read of ``adapter_id``: its next use reads it again, while resident
        versions serve only the requests that started under them."""
        self.host.drop(adapter_id)
        self._read_ms.pop(adapter_id, None)
        self._stamps.pop(adapter_id, None)
        for entry in self.residents():
            if entry.adapter_id == adapter_id:
                entry.stale = True

    def knows(self, adapter_id: str) -> bool:
        return self._registration(adapter_id) is not None

    def _registration(self, adapter_id: str) -> AdapterEntry | None:
        """Where ``adapter_id``'s files are (the one place residency asks the registry)."""
        return self.registry.get(adapter_id)

    # lookups
    def residents(self) -> list[Resident]:
        return [entry for entry in self.seats if entry is not None]

    def current(self, adapter_id: str) -> Resident | None:
        """The resident entry of ``adapter_id``'s current weights, if any."""
        for entry in self.seats:
            if entry is not None and entry.adapter_id == adapter_id and not entry.stale:
                return entry
        return None

    def _version(self, adapter_id: str, content_hash: str) -> Resident | None:
        for entry in self.seats:
            if entry is not None and (entry.adapter_id, entry.content_hash) == (
                adapter_id,
                content_hash,
            ):
                return entry
        return None

    def tier(self, adapter_id: str) -> Lookup:
        """Where ``adapter_id`` is now. Raises :class:`AdapterError` for an unknown adapter."""
        where = self._where(adapter_id)
        if where is None:
            raise AdapterError(f"adapter {adapter_id!r} is not known")
        return where

    def need(self, seq: Sequence) -> Need:
        """Where ``seq``'s adapter stands for ``seq``: a running request computes with the
        version it started under, a waiting one with the current weights."""
        adapter_id, started_under = seq.adapter_id, seq.adapter_hash
        assert adapter_id is not None
        if seq.status is not Status.RUNNING:
            started_under = None
        if started_under is None:
            resident = self.current(adapter_id)
        else:
            resident = self._version(adapter_id, started_under)
        return Need(adapter_id, started_under, resident)

    def version_gone(self, need: Need) -> bool:
        """Whether ``need``'s request started under weights that are neither resident nor
        current."""
        host = self.host.entries.get(need.adapter_id)
        return (
            need.started_under is not None
            and need.resident is None
            and host is not None
            and host.content_hash != need.started_under
        )

    def load_evicts(self, adapter_id: str) -> bool:
        """Whether bringing ``adapter_id``'s current weights in now evicts an adapter (or, in
        merged mode, merged weights) that requests still need."""
        if self._where(adapter_id) is not Lookup.WARM:
            return False
        if self.merge is not None:
            return self.merged is not None
        return self._needs_eviction(adapter_id)

    def _where(self, adapter_id: str) -> Lookup | None:
        if self.current(adapter_id) is not None or (
            self.merged is not None and self.merged.adapter_id == adapter_id
        ):
            return Lookup.HOT
        if adapter_id in self.loader.pending:
            return Lookup.LOADING
        if adapter_id in self.host.entries:
            return Lookup.WARM
        if self._registration(adapter_id) is None:
            return None
        return Lookup.COLD

    def pages_by_adapter(self, adapter_ids: Iterable[str]) -> dict[str, int]:
        """Pages each resident adapter, and each of ``adapter_ids`` in host memory, takes in the
        pool."""
        if self.pool is None:
            return {}
        host = self.host.entries
        pages = {a: self._layout(host[a]).num_pages for a in adapter_ids if a in host}
        for entry in self.residents():
            pages.setdefault(entry.adapter_id, entry.num_pages)
        return pages

    def _pages_needed(self, adapter_id: str) -> int | None:
        """Pages ``adapter_id`` takes in the pool, when its weights are in host memory."""
        adapter = self.host.entries.get(adapter_id)
        return None if adapter is None or self.pool is None else self._layout(adapter).num_pages

    def _needs_eviction(self, adapter_id: str) -> bool:
        """Whether bringing ``adapter_id`` in now must evict an adapter that requests still need
        (thrash). Taking a free seat and free pages, or those of adapters no request needs, is
        not."""
        now = time.monotonic()
        order = eviction_order(self.resident_views(), now, self.quantum_s)
        idle = [e for e in order if not self.demand[e.adapter_id]]
        if all(entry is not None for entry in self.seats) and not idle:
            return True
        pages = self._pages_needed(adapter_id)
        room = self.blocks.num_free_blocks + sum(e.num_pages for e in idle)
        return pages is not None and pages > room

    # the step
    def begin_step(self, demand: Counter[str], bound: Counter[tuple[str, str]]) -> None:
        """A new step is being formed: no request uses any adapter yet."""
        self.demand, self.bound = demand, bound
        self.short_of_pages = False  # set when a load waits for pages that KV in use holds
        for entry in self.residents():
            entry.in_step = 0
        self._drop_unused_stale()

    def end_step(self) -> None:
        """The step ran: no request computes with any adapter until the next one is formed."""
        for entry in self.residents():
            entry.in_step = 0

    def use(self, entry: Resident) -> None:
        entry.in_step += 1
        entry.last_used = time.monotonic()

    def resident_views(self) -> list[ResidentView[Resident]]:
        """The residents as the victim choice sees them (``policies.victims``)."""
        return [self._view(entry) for entry in self.residents()]

    def _view(self, entry: Resident) -> ResidentView[Resident]:
        """Held: used by the step being formed, pinned, or old weights running requests still
        compute with. Needed: requests need its current weights (old weights never are)."""
        users = self.bound[entry.adapter_id, entry.content_hash]
        pinned = entry.adapter_id in self.usage.pinned and not entry.stale
        return ResidentView(
            entry,
            entry.last_used,
            entry.loaded_at,
            needed=not entry.stale and self.demand[entry.adapter_id] > 0,
            held=bool(entry.in_step) or pinned or (entry.stale and users > 0),
        )

    def evictable(self, entry: Resident, now: float) -> bool:
        """Whether ``entry`` may leave the pool now (``policies.victims.may_leave``)."""
        return may_leave(self._view(entry), now, self.quantum_s)

    def choose_seat(self, now: float) -> int | None:
        """A free seat, else the seat of the engine's first victim
        (``policies.victims.eviction_order``)."""
        for seat, entry in enumerate(self.seats):
            if entry is None:
                return seat
        order = eviction_order(self.resident_views(), now, self.quantum_s)
        return order[0].seat if order else None

    def acquire(
        self,
        need: Need,
        seat: int | None,
        holders: Iterable[Sequence],
        *,
        parked: bool = False,
        evict: Iterable[int] = (),
    ) -> Resident | None:
        """Make the current weights of the adapter ``need`` names resident, in ``seat`` (or the
        seat :meth:`choose_seat` picks), evicting what is there; when pages are short, then the
        adapters in the seats ``evict`` names (those that may leave now), then adapters no
        request needs, least recently used first. None means wait: its read from
        disk is under way (started now if it was cold), or no seat or pages can be freed now.
        ``holders`` are the sequences that hold KV blocks (they may be moved). A load that
        evicts an adapter requests still need counts as thrash (``usage.evicting_loads``) unless
        it is for ``parked`` requests, whose reloads the quantum paces. Raises
        :class:`AdapterError` when the adapter is unknown or cannot fit in the pool at all."""
        assert self.pool is not None, "merged mode has no pool"
        adapter_id = need.adapter_id
        entry = self.current(adapter_id)
        if entry is not None:
            return entry
        now = time.monotonic()
        adapter = self.host.get(adapter_id)
        if adapter is None:
            if self.tier(adapter_id) is Lookup.COLD:
                self._read_from_disk(adapter_id)
            return None
        layout = self._layout(adapter)
        if layout.num_pages > self.pool.num_pages:
            raise AdapterError(
                f"adapter {adapter_id!r} needs {layout.nbytes} bytes, more than the whole cache "
                f"pool ({self.pool.nbytes()} bytes)"
            )
        if seat is None:
            seat = self.choose_seat(now)
        if seat is None or not 0 <= seat < len(self.seats):
            return None
        occupant = self.seats[seat]
        if occupant is not None and not self.evictable(occupant, now):
            return None
        victims = [occupant] if occupant is not None else []
        freed = self.blocks.num_free_blocks + sum(v.num_pages for v in victims)
        if freed < layout.num_pages:
            named = [self.seats[s] for s in evict if 0 <= s < len(self.seats)]
            order = eviction_order(self.resident_views(), now, self.quantum_s)
            idle = [e for e in order if e not in victims and not self.demand[e.adapter_id]]
            chosen = [e for e in named if e is not None and self.evictable(e, now)]
            for extra in dict.fromkeys([*chosen, *idle]):
                if extra in victims:
                    continue
                if freed >= layout.num_pages:
                    break
                victims.append(extra)
                freed += extra.num_pages
            if freed < layout.num_pages:
                self.short_of_pages = True
                return None  # the pool is full of KV in use: wait for requests to finish
        thrash = not parked and self.load_evicts(adapter_id)  # before the pool changes
        started = time.perf_counter()
        for victim in victims:
            self.evict(victim)
        first = self.top
        for src, dst in self.blocks.claim(range(first, first + layout.num_pages), holders):
            self.pool.copy_page(src, dst)
        self.top += layout.num_pages
        self.pool.write(adapter, layout, first)
        entry = Resident(
            adapter_id, adapter.content_hash, seat, first, layout,
            self.pool.views(layout, first), now, now,
        )  # fmt: skip
        self.seats[seat] = entry
        if not self.max_loras and None not in self.seats:
            self.seats.append(None)  # no cap: a free seat is always there
        self.stats.peak_resident = max(self.stats.peak_resident, len(self.residents()))
        self._loaded(adapter_id, seat, started)
        if thrash:
            self.usage.evicting_loads.add(adapter_id)
        return entry

    def evict_for_kv(self, keep: Resident | None) -> bool:
        """Evict the least recently used adapter that may give its pages to KV blocks
        (``policies.victims.kv_order``), other than ``keep``; False when there is none. KV in use
        outranks the quantum: the requests that need the adapter wait for it, parked or
        queued."""
        order = kv_order(v for v in self.resident_views() if v.resident is not keep)
        if not order:
            return False
        self.evict(order[0])
        return True

    def evict(self, entry: Resident) -> None:
        """Take ``entry`` out of the pool; the adapters above it move down so no hole is left,
        and its KV namespace's cached blocks become the first to be reused."""
        assert self.pool is not None
        n = entry.num_pages
        self.seats[entry.seat] = None
        for other in sorted(self.residents(), key=lambda e: e.first_page):
            if other.first_page > entry.first_page:
                self.pool.move_pages(other.first_page, other.first_page - n, other.num_pages)
                other.first_page -= n
                other.layers = self.pool.views(other.layout, other.first_page)
        self.top -= n
        self.blocks.release_pages(range(self.top, self.top + n))
        self.blocks.demote(lambda scope: scope is not None and scope.adapter_id == entry.adapter_id)
        self.stats.evictions += 1
        if self.events is not None:
            self.events.notify(
                "lora_guard_adapter_evicted", adapter_id=entry.adapter_id, slot=entry.seat
            )

    # disk
    def _read_from_disk(self, adapter_id: str) -> None:
        self._load_started[adapter_id] = time.perf_counter()
        self.usage.disk_reads.add(adapter_id)
        entry = self._registration(adapter_id)
        assert entry is not None
        self.loader.submit(adapter_id, entry.path, entry.root)

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

    # merged mode
    def acquire_merged(self, adapter_id: str | None, *, evicts: bool = False) -> Binding | None:
        """Bind a request to the merged weights of ``adapter_id`` (None: the base model), held
        until :meth:`release_merged`; None means wait. A merge that ``evicts`` weights requests
        still need counts as thrash."""
        assert self.merge is not None
        started = time.perf_counter()
        current = self.merged.adapter_id if self.merged is not None else None
        if current == adapter_id:
            self.merged_refs += 1
            return Binding(self.merged.content_hash if self.merged else None)
        adapter = None
        if adapter_id is not None:
            adapter = self.host.get(adapter_id)
            if adapter is None:
                if self.tier(adapter_id) is Lookup.COLD:
                    self._read_from_disk(adapter_id)
                return None
        if self.merged_refs:
            return None  # running requests still use the weights merged now
        if current is not None:
            self.stats.evictions += 1
            if self.events is not None:
                self.events.notify("lora_guard_adapter_evicted", adapter_id=current, slot=-1)
        self.merge(adapter)
        self.merged = adapter
        self.merged_refs = 1
        if adapter is not None:
            self._loaded(adapter.adapter_id, -1, started)
            if evicts:
                self.usage.evicting_loads.add(adapter.adapter_id)
        return Binding(adapter.content_hash if adapter else None)

    def release_merged(self) -> None:
        self.merged_refs -= 1
        assert self.merged_refs >= 0, "merged weights released twice"

    # helpers
    def _loaded(self, adapter_id: str, seat: int, started: float) -> None:
        read_ms = self._read_ms.pop(adapter_id, None)
        tier = Lookup.COLD if read_ms is not None else Lookup.WARM
        swap_ms = (read_ms or 0.0) + (time.perf_counter() - started) * 1000
        self.stats.loads += 1
        self.stats.swap_ms.append(swap_ms)
        if self.events is not None:
            self.events.notify(
                "lora_guard_adapter_loaded",
                adapter_id=adapter_id, slot=seat, tier=tier.value, swap_ms=swap_ms,
            )  # fmt: skip

    def _layout(self, adapter: LoRAAdapter) -> AdapterLayout:
        assert self.pool is not None
        layout = self._layouts.get(adapter.content_hash)
        if layout is None:
            layout = self._layouts[adapter.content_hash] = self.pool.layout(adapter)
        return layout

    def _drop_unused_stale(self) -> None:
        for entry in self.residents():
            users = self.bound[entry.adapter_id, entry.content_hash]
            if entry.stale and entry.in_step == 0 and not users:
                self.evict(entry)
