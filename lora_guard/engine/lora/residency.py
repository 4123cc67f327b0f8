"""Which adapters are resident in the pool, decided step by step.

Three tiers: the pool (hot), host memory (warm), the adapter's folder on disk (cold). A cold
adapter is read on the loader thread; the requests that need it wait without holding up others.
An adapter comes in when a request needs it and a seat and pages can be had: its seat's occupant
leaves, and when pages are short, the pool gives back what the eviction choice orders (idle
adapters and cached prefix blocks alike, ``lora_guard_cache_evict``). The pool's free pages cap
the adapters' bytes; who is in which seat, and who may leave, is ``seats.py``.

The registry, the host tier and the disk reads are every residency's (``tiers.py``); merged
mode, the baselines' one adapter merged into the base weights at a time, is ``merged.py``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from collections.abc import Sequence as Seq

from lora_guard.clock import timer
from lora_guard.engine.lora.checkpoint import AdapterError
from lora_guard.engine.lora.seats import Resident, Seats
from lora_guard.engine.lora.tiers import Lookup, Need
from lora_guard.engine.sequence import Sequence
from lora_guard.plugins.decisions import Load
from lora_guard.plugins.eviction import (
    ADAPTER,
    PREFIX,
    Candidate,
    choose,
    eviction_order,
    kv_order,
)


class ResidencyManager(Seats):
    """Adapters paged into the cache pool beside the KV, brought in and evicted (see above)."""

    # registry
    def unregister(self, adapter_id: str) -> None:
        super().unregister(adapter_id)
        self._drop_unused_stale()

    def load_evicts(self, need: Need) -> bool:
        """Whether bringing ``need``'s current weights in now evicts an adapter that requests
        still need."""
        if need.adapter_id is None or self._where(need.adapter_id) is not Lookup.WARM:
            return False
        return self._needs_eviction(need.adapter_id)

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
    def begin_step(
        self, demand: Counter[str], bound: Counter[tuple[str | None, str | None]]
    ) -> None:
        super().begin_step(demand, bound)
        for entry in self.residents():
            entry.in_step = 0
        self._drop_unused_stale()

    def bring_in(self, need: Need, how: Load, holders: Iterable[Sequence], parked: bool) -> bool:
        """Make the current weights of the adapter ``need`` names resident, in ``how.slot`` (or
        the seat :meth:`choose_seat` picks), evicting what is there; when pages are short, then
        the adapters in the seats ``how.evict`` names (those that may leave now), then what the
        pool's eviction choice gives back. False means wait: its read from disk is under way
        (started now if it was cold), or no seat or pages can be freed now. ``holders`` are the
        sequences that hold KV blocks (they may be moved). A load that evicts an adapter
        requests still need counts as thrash (``usage.evicting_loads``) unless it is for
        ``parked`` requests, whose reloads the quantum paces. Raises :class:`AdapterError` when
        the adapter is unknown or cannot fit in the pool at all."""
        adapter_id = need.adapter_id
        assert adapter_id is not None, "the base model's weights are never loaded"
        if self.current(adapter_id) is not None:
            return True
        now = self.clock()
        adapter = self._host_or_read(adapter_id)
        if adapter is None:
            return False
        layout = self.pages.layout(adapter)
        if layout.num_pages > self.pages.adapter_region:
            raise AdapterError(
                f"adapter {adapter_id!r} needs {layout.nbytes} bytes, more than the cache pool "
                f"keeps for adapters ({self.pages.adapter_region} pages)"
            )
        seat = how.slot if how.slot is not None else self.choose_seat(now)
        if seat is None or not 0 <= seat < len(self.seats):
            return False
        victims = self._victims(seat, layout.num_pages, how.evict, now)
        if victims is None:
            return False
        thrash = not parked and self.load_evicts(need)  # before the pool changes
        read_ms = self._read_ms.get(adapter_id)  # read from disk for this load
        if read_ms is not None and not self.costs.external:
            self.costs.read(layout.num_pages, read_ms)
        started = timer()
        for victim in victims:
            self.evict(victim)
        self._free_pages(layout.num_pages, "adapter")
        run = self.pages.place(adapter, holders)
        if not self.costs.external:
            self.costs.write(layout.num_pages, (timer() - started) * 1000)
        entry = Resident(adapter_id, adapter.content_hash, seat, run, now, now)
        self.seats[seat] = entry
        if not self.max_loras and None not in self.seats:
            self.seats.append(None)  # no cap: a free seat is always there
        self.stats.peak_resident = max(self.stats.peak_resident, len(self.residents()))
        self._loaded(adapter_id, seat, started)
        if thrash:
            self.usage.evicting_loads.add(adapter_id)
        return True

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
        cached = 0 if self.pages.partitioned else len(self.blocks.idle_cached())
        if self._blank(victims) + cached + idle < pages:
            self.short_of_pages = True
            return None  # the pool is full of KV in use: wait for requests to finish
        return victims

    def _blank(self, victims: Iterable[Resident]) -> int:
        """Pages an adapter could take now with ``victims`` gone, nothing else leaving."""
        return self.pages.blank(sum(v.num_pages for v in victims))

    def evict_for_kv(self, keep: Resident | None) -> bool:
        """Evict the least recently used adapter that may give its pages to KV blocks
        (``plugins.eviction.kv_order``), other than ``keep``; False when there is none. KV in use
        outranks the quantum: the requests that need the adapter wait for it, parked or
        queued."""
        if self.pages.partitioned:
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
        if purpose == "adapter" or not self.pages.partitioned:  # each kind gives pages to its own
            candidates += self._idle_adapters(now, exclude)
        if purpose == "kv" or not self.pages.partitioned:
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
        self.seats[entry.seat] = None
        self.pages.remove(entry.run)
        self.blocks.demote(lambda scope: scope is not None and scope.adapter_id == entry.adapter_id)
        self._evicted(entry.adapter_id, entry.seat)

    def _drop_unused_stale(self) -> None:
        for entry in self.residents():
            users = self.bound[entry.adapter_id, entry.content_hash]
            if entry.stale and entry.in_step == 0 and not users:
                self.evict(entry)
