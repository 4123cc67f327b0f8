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

The registry, the host tier and the disk reads are every residency's (``tiers.py``); merged
mode, the baselines' one adapter merged into the base weights at a time, is ``merged.py``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import torch

from lora_guard.clock import monotonic, timer
from lora_guard.engine.kv_cache import BlockManager
from lora_guard.engine.lora.checkpoint import AdapterError, LoRAAdapter
from lora_guard.engine.lora.compute import kernel_plan
from lora_guard.engine.lora.loader import AdapterLoader, HostCache
from lora_guard.engine.lora.pool import AdapterLayout, CachePool, LayerWeights
from lora_guard.engine.lora.registry import AdapterRegistry
from lora_guard.engine.lora.tiers import Lookup, Need, Residency
from lora_guard.engine.sequence import Sequence, Status
from lora_guard.plugins.eviction import (
    ADAPTER,
    PREFIX,
    Candidate,
    ResidentView,
    choose,
    eviction_order,
    kv_order,
    may_leave,
)
from lora_guard.plugins.manager import Hooks
from lora_guard.plugins.state import SlotView


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


class ResidencyManager(Residency):
    """Adapters paged into the cache pool beside the KV, in ``max_loras`` seats (see above)."""

    def __init__(
        self,
        pool: CachePool,
        blocks: BlockManager,
        host: HostCache,
        loader: AdapterLoader,
        registry: AdapterRegistry,
        max_loras: int,
        quantum_s: float = 1.0,
        events: Hooks | None = None,
        clock: Callable[[], float] = monotonic,
    ) -> None:
        super().__init__(blocks, host, loader, registry, max_loras, events, clock)
        self.pool, self.quantum_s = pool, quantum_s
        self.seats = [None] * max(self.max_loras, 1)
        self.top = 0  # pages [0, top) hold adapters
        self._layouts: dict[str, AdapterLayout] = {}  # by content hash

    # registry
    def unregister(self, adapter_id: str) -> None:
        super().unregister(adapter_id)
        self._drop_unused_stale()

    def _forget(self, adapter_id: str) -> None:
        """Resident versions of a forgotten adapter serve only the requests that started under
        them."""
        super()._forget(adapter_id)
        for entry in self.residents():
            if entry.adapter_id == adapter_id:
                entry.stale = True

    # lookups
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

    def is_hot(self, adapter_id: str | None) -> bool:
        return adapter_id is not None and self.current(adapter_id) is not None

    def need(self, seq: Sequence) -> Need | None:
        """Where ``seq``'s adapter stands for ``seq``: a running request computes with the
        version it started under, a waiting one with the current weights. None for the base
        model, whose weights never leave."""
        adapter_id, started_under = seq.adapter_id, seq.adapter_hash
        if adapter_id is None:
            return None
        if seq.status is not Status.RUNNING:
            started_under = None
        if started_under is None:
            resident = self.current(adapter_id)
        else:
            resident = self._version(adapter_id, started_under)
        if resident is None:
            return Need(adapter_id, started_under, ready=False)
        return Need(adapter_id, started_under, True, resident.content_hash, resident)

    def version_gone(self, need: Need) -> bool:
        """Whether ``need``'s request started under weights that are neither resident nor
        current."""
        if need.adapter_id is None:
            return False
        host = self.host.entries.get(need.adapter_id)
        return (
            need.started_under is not None
            and need.resident is None
            and host is not None
            and host.content_hash != need.started_under
        )

    def load_evicts(self, need: Need) -> bool:
        """Whether bringing ``need``'s current weights in now evicts an adapter that requests
        still need."""
        if need.adapter_id is None or self._where(need.adapter_id) is not Lookup.WARM:
            return False
        return self._needs_eviction(need.adapter_id)

    def ranks(self) -> dict[str, int]:
        ranks = super().ranks()
        for entry in self.residents():
            ranks.setdefault(entry.adapter_id, entry.layout.rank)
        return ranks

    def pages_by_adapter(self, adapter_ids: Iterable[str]) -> dict[str, int]:
        """Pages each resident adapter, and each of ``adapter_ids`` in host memory, takes in the
        pool."""
        host = self.host.entries
        pages = {a: self._layout(host[a]).num_pages for a in adapter_ids if a in host}
        for entry in self.residents():
            pages.setdefault(entry.adapter_id, entry.num_pages)
        return pages

    def _pages_needed(self, adapter_id: str) -> int | None:
        """Pages ``adapter_id`` takes in the pool, when its weights are in host memory."""
        adapter = self.host.entries.get(adapter_id)
        return None if adapter is None else self._layout(adapter).num_pages

    def _needs_eviction(self, adapter_id: str) -> bool:
        """Whether bringing ``adapter_id`` in now must evict an adapter that requests still need
        (thrash). Taking a free seat and free pages, or those of adapters no request needs, is
        not."""
        now = self.clock()
        order = eviction_order(self.resident_views(), now, self.quantum_s)
        idle = [e for e in order if not self.demand[e.adapter_id]]
        if all(entry is not None for entry in self.seats) and not idle:
            return True
        pages = self._pages_needed(adapter_id)
        room = self.blocks.num_free_blocks + sum(e.num_pages for e in idle)
        return pages is not None and pages > room

    # the step
    def slot_views(self, running: Counter[str], now: float) -> tuple[SlotView, ...]:
        return tuple(
            SlotView(seat, None, 0, 0.0)
            if e is None
            else SlotView(
                seat,
                e.adapter_id,
                running[e.adapter_id],
                e.last_used,
                self.evictable(e, now),
                e.num_pages,
                e.loaded_at,
            )
            for seat, e in enumerate(self.seats)
        )

    def begin_step(
        self, demand: Counter[str], bound: Counter[tuple[str | None, str | None]]
    ) -> None:
        super().begin_step(demand, bound)
        for entry in self.residents():
            entry.in_step = 0
        self._drop_unused_stale()

    def end_step(self) -> None:
        """The step ran: no request computes with any adapter until the next one is formed."""
        for entry in self.residents():
            entry.in_step = 0

    def use(self, need: Need) -> None:
        entry = need.resident
        if entry is not None:
            entry.in_step += 1
            entry.last_used = self.clock()

    def resident_views(self) -> list[ResidentView[Resident]]:
        """The residents as the victim choice sees them (``plugins.eviction``)."""
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
        """Whether ``entry`` may leave the pool now (``plugins.eviction.may_leave``)."""
        return may_leave(self._view(entry), now, self.quantum_s)

    def choose_seat(self, now: float) -> int | None:
        """A free seat, else the seat of the engine's first victim
        (``plugins.eviction.eviction_order``)."""
        for seat, entry in enumerate(self.seats):
            if entry is None:
                return seat
        order = eviction_order(self.resident_views(), now, self.quantum_s)
        return order[0].seat if order else None

    def bring_in(
        self,
        need: Need,
        seat: int | None,
        holders: Iterable[Sequence],
        *,
        parked: bool = False,
        evict: Iterable[int] = (),
    ) -> bool:
        return self.acquire(need, seat, holders, parked=parked, evict=evict) is not None

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
        adapter_id = need.adapter_id
        assert adapter_id is not None, "the base model's weights are never loaded"
        entry = self.current(adapter_id)
        if entry is not None:
            return entry
        now = self.clock()
        adapter = self._host_or_read(adapter_id)
        if adapter is None:
            return None
        layout = self._layout(adapter)
        if layout.num_pages > self.adapter_region:
            raise AdapterError(
                f"adapter {adapter_id!r} needs {layout.nbytes} bytes, more than the cache pool "
                f"keeps for adapters ({self.adapter_region} pages)"
            )
        if seat is None:
            seat = self.choose_seat(now)
        if seat is None or not 0 <= seat < len(self.seats):
            return None
        victims = self._victims(seat, layout.num_pages, evict, now)
        if victims is None:
            return None
        thrash = not parked and self.load_evicts(need)  # before the pool changes
        read_ms = self._read_ms.get(adapter_id)  # read from disk for this load
        if read_ms is not None and not self.costs.external:
            self.costs.read(layout.num_pages, read_ms)
        started = timer()
        for victim in victims:
            self.evict(victim)
        self._free_pages(layout.num_pages, "adapter")
        first = self.top
        for src, dst in self.blocks.claim(range(first, first + layout.num_pages), holders):
            self.pool.copy_page(src, dst)
        self.top += layout.num_pages
        self.pool.write(adapter, layout, first)
        if not self.costs.external:
            self.costs.write(layout.num_pages, (timer() - started) * 1000)
        views = self.pool.views(layout, first)
        entry = Resident(adapter_id, adapter.content_hash, seat, first, layout, views, now, now)
        self.seats[seat] = entry
        if not self.max_loras and None not in self.seats:
            self.seats.append(None)  # no cap: a free seat is always there
        self.stats.peak_resident = max(self.stats.peak_resident, len(self.residents()))
        self._loaded(adapter_id, seat, started)
        if thrash:
            self.usage.evicting_loads.add(adapter_id)
        return entry

    def _victims(
        self, seat: int, pages: int, evict: Iterable[int], now: float
    ) -> list[Resident] | None:
        """What leaves for an adapter of ``pages`` pages to take ``seat``: its occupant, then
        the seats ``evict`` names (those that may leave now) until the blank pages suffice;
        the pool's choice (``_free_pages``) does the rest. None: the occupant may not leave
        yet, or the pool cannot free the pages now (KV in use holds them)."""
        occupant = self.seats[seat]
        if occupant is not None and not self.evictable(occupant, now):
            return None
        victims = [occupant] if occupant is not None else []
        if self._blank(victims) >= pages:
            return victims
        for extra in (self.seats[s] for s in evict if 0 <= s < len(self.seats)):
            if extra is None or extra in victims or not self.evictable(extra, now):
                continue
            if self._blank(victims) >= pages:
                break
            victims.append(extra)
        idle = sum(c.pages for c in self._idle_adapters(now, victims))
        cached = 0 if self.partitioned else len(self.blocks.idle_cached())
        if self._blank(victims) + cached + idle < pages:
            self.short_of_pages = True
            return None  # the pool is full of KV in use: wait for requests to finish
        return victims

    @property
    def partitioned(self) -> bool:
        """Whether adapters have pages of their own (``adapter_memory``) that KV never takes."""
        return self.blocks.kv_pages is not None and self.blocks.kv_pages < self.blocks.num_blocks

    @property
    def adapter_region(self) -> int:
        """Pages adapters may hold together."""
        blocks = self.blocks
        return blocks.num_blocks - (blocks.kv_pages or 0) if self.partitioned else blocks.num_blocks

    def _blank(self, victims: Iterable[Resident]) -> int:
        """Pages an adapter could take now with ``victims`` gone, nothing else leaving."""
        freed = sum(v.num_pages for v in victims)
        if self.partitioned:
            return self.adapter_region - len(self.blocks.reserved) + freed
        return self.blocks.num_blank_pages + freed

    def evict_for_kv(self, keep: Resident | None) -> bool:
        """Evict the least recently used adapter that may give its pages to KV blocks
        (``plugins.eviction.kv_order``), other than ``keep``; False when there is none. KV in use
        outranks the quantum: the requests that need the adapter wait for it, parked or
        queued."""
        if self.partitioned:
            return False  # the adapters' pages are theirs alone
        order = kv_order(v for v in self.resident_views() if v.resident is not keep)
        if not order:
            return False
        self.evict(order[0])
        return True

    def make_room(
        self, pages: int, keep: Resident | None = None, protect: Iterable[int] = ()
    ) -> None:
        """Empty ``pages`` pages for KV if it can, by the pool's eviction choice over cached
        prefix blocks and the adapters no request needs (other than ``keep``); ``protect``:
        the blocks the asking request reuses."""
        self._free_pages(pages, "kv", [keep] if keep is not None else [], protect)

    def _free_pages(
        self,
        pages: int,
        purpose: str,
        exclude: Iterable[Resident] = (),
        protect: Iterable[int] = (),
    ) -> None:
        """Free cached blocks and idle adapters, in the order ``lora_guard_cache_evict`` gives
        (least recently used first by default), until ``pages`` pages are empty or the order
        runs out."""
        if purpose == "adapter":
            short = pages - self._blank(())
        else:
            short = pages - self.blocks.num_empty_blocks
        if short <= 0:
            return
        now = self.clock()
        candidates: list[Candidate] = []
        if purpose == "adapter" or not self.partitioned:  # each kind gives pages to its own
            candidates += self._idle_adapters(now, exclude)
        if purpose == "kv" or not self.partitioned:
            candidates += self._idle_blocks(now, protect)
        events = self.events
        order = None
        if events is not None and events.has("lora_guard_cache_evict"):

            def order(offered: Seq[Candidate]) -> Seq[Candidate] | None:
                return events.cache_evict(candidates=offered, pages=short, purpose=purpose, now=now)

        for chosen in choose(candidates, short, order):
            if chosen.kind == PREFIX:
                self.blocks.drop(int(chosen.key))  # type: ignore[call-overload]
            else:
                entry = self.seats[int(chosen.key)]  # type: ignore[call-overload]
                if entry is not None:
                    self.evict(entry)

    def _idle_adapters(self, now: float, exclude: Iterable[Resident] = ()) -> list[Candidate]:
        """Adapters that may leave now and that no request needs (but ``exclude``), as
        candidates."""
        heat, skip = self.usage.heat(now), set(map(id, exclude))
        return [
            Candidate(
                ADAPTER,
                entry.seat,
                entry.num_pages,
                entry.last_used,
                heat.get(entry.adapter_id, 0),
                self.costs.adapter_ms(entry.num_pages, entry.adapter_id in self.host.entries),
                entry.adapter_id,
                0,
                entry.loaded_at,
            )
            for entry in eviction_order(self.resident_views(), now, self.quantum_s)
            if id(entry) not in skip and (entry.stale or not self.demand[entry.adapter_id])
        ]

    def _idle_blocks(self, now: float, protect: Iterable[int] = ()) -> list[Candidate]:
        """Cached blocks no request holds (but ``protect``), as candidates."""
        heat, prefill_ms = self.usage.heat(now), self.costs.prefill_ms(self.blocks.block_size)
        out = []
        for block in self.blocks.idle_cached(set(protect)):
            adapter = block.scope.adapter_id if block.scope is not None else None
            out.append(
                Candidate(
                    PREFIX,
                    block.block_id,
                    1,
                    block.last_used,
                    block.hits,
                    prefill_ms,
                    adapter,
                    block.depth,
                    block.cached_at,
                    heat.get(adapter, 0) if adapter is not None else 0,
                )
            )
        return out

    def evict(self, entry: Resident) -> None:
        """Take ``entry`` out of the pool; the adapters above it move down so no hole is left,
        and its KV namespace's cached blocks become the first to be reused."""
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
        self._evicted(entry.adapter_id, entry.seat)

    # helpers
    def _layout(self, adapter: LoRAAdapter) -> AdapterLayout:
        layout = self._layouts.get(adapter.content_hash)
        if layout is None:
            layout = self._layouts[adapter.content_hash] = self.pool.layout(adapter)
        return layout

    def _drop_unused_stale(self) -> None:
        for entry in self.residents():
            users = self.bound[entry.adapter_id, entry.content_hash]
            if entry.stale and entry.in_step == 0 and not users:
                self.evict(entry)
