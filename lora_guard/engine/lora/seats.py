"""The pool's seats: which version of which adapter is where, which may leave, and how the
policies see them.

Residency is per step: a request uses its adapter only while it is in a step's batch (``use``),
so between two steps any resident adapter may leave, and the running requests that need it wait,
parked with their KV kept, until it comes back. What keeps this from thrashing is the residency
quantum: an adapter that running or waiting requests still need stays at least
``quantum_s`` after its load. ``max_loras`` seats, when set, cap how many adapters are resident
at once (0, the default: no cap, a free seat is always there and the pool's pages alone decide,
as in S-LoRA's unified paging). A replaced adapter's old weights stay in their seat, ``stale``,
while requests that started under them run.

Bringing adapters in and taking them out is the residency manager's (``residency.py``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from lora_guard.clock import monotonic
from lora_guard.engine.lora.pool import AdapterLayout, LayerWeights
from lora_guard.engine.lora.tiers import Need, Residency, Sources
from lora_guard.engine.page_pool import AdapterRun, PagePool
from lora_guard.engine.sequence import Sequence, Status
from lora_guard.plugins.eviction import ResidentView, eviction_order, may_leave
from lora_guard.plugins.manager import Hooks
from lora_guard.plugins.state import SlotView


@dataclass(eq=False)
class Resident:
    """One version of an adapter in a seat, its weights in a run of the pool's pages."""

    adapter_id: str
    content_hash: str
    seat: int
    run: AdapterRun
    loaded_at: float
    last_used: float
    in_step: int = 0  # requests of the step being formed that compute with it
    stale: bool = False  # replaced on disk: serves only the requests that started under it

    @property
    def first_page(self) -> int:
        return self.run.first_page

    @property
    def num_pages(self) -> int:
        return self.run.num_pages

    @property
    def layout(self) -> AdapterLayout:
        return self.run.layout

    @property
    def layers(self) -> list[LayerWeights]:
        return self.run.layers


class Seats(Residency):
    """Adapters in ``max_loras`` seats, their weights in runs of the page pool (see above)."""

    def __init__(
        self,
        pages: PagePool,
        sources: Sources,
        max_loras: int,
        quantum_s: float = 1.0,
        events: Hooks | None = None,
        clock: Callable[[], float] = monotonic,
    ) -> None:
        super().__init__(sources, max_loras, events, clock)
        self.pages, self.blocks, self.quantum_s = pages, pages.blocks, quantum_s
        self.seats = [None] * max(self.max_loras, 1)

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

    def ranks(self) -> dict[str, int]:
        ranks = super().ranks()
        for entry in self.residents():
            ranks.setdefault(entry.adapter_id, entry.layout.rank)
        return ranks

    def pages_by_adapter(self, adapter_ids: Iterable[str]) -> dict[str, int]:
        """Pages each resident adapter, and each of ``adapter_ids`` in host memory, takes in the
        pool."""
        host = self.host.entries
        pages = {a: self.pages.layout(host[a]).num_pages for a in adapter_ids if a in host}
        for entry in self.residents():
            pages.setdefault(entry.adapter_id, entry.num_pages)
        return pages

    def _pages_needed(self, adapter_id: str) -> int | None:
        """Pages ``adapter_id`` takes in the pool, when its weights are in host memory."""
        adapter = self.host.entries.get(adapter_id)
        return None if adapter is None else self.pages.layout(adapter).num_pages

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
