"""Hot-set admission: seat the adapters worth the most, keep the pages worth the most per page
resident, keep one tenant's flood from crowding out the others, and bound how long any request
waits.

Adapters cannot be served from outside the pool: each running request needs its adapter resident
at every step it computes. Batch form offers waiting requests first come first served; one whose
adapter cannot be brought in yet (its pages find no room but that of adapters running requests
use) waits for its adapter (``adapter_load`` defers it) and never holds back one behind it whose
adapter is resident; one whose adapter is still being read from disk holds nobody's place.
Nothing is held back for pages or KV it might need: holding requests until their adapter's pages
and their KV fit beside the running batch cost the tail more than the thrash it avoided (under
``pressure``, lora-guard's TTFT p95 1.29x LRU's with the hold, 0.97x without; docs/benchmarks.md).
When the seats (``max_loras``) are full, the request is offered all the same; if it
would end before some seated adapter's running requests do (``EngineState.steps_left``), its
adapter takes its turn: once a seat's residency quantum is over, the adapter running requests
use least valuably leaves for it (they wait, parked, with their KV), as time slices do, so a
short request for a new adapter never waits for whole long requests of others. One longer
than every seated adapter's requests waits for a seat to free: parking running requests for it
would cost them a reload each, for no request ending sooner. A
tenant running more than twice its share of the batch (running requests over active tenants)
goes after every other tenant's requests, and then only while it leaves a batch place
(``max_num_seqs``) for one request of each other tenant with recent traffic. A request that has
waited ``max_adapter_wait_s`` goes ahead of all, and no request for an adapter outside the
working set (the adapters running requests use) is admitted before it; when its adapter cannot
be seated, the running adapter it would displace first takes no new requests until its running
ones end (it drains), so the wait stays bounded even where running requests cannot be parked
(inside vLLM).

Heat is the number of requests per adapter over a sliding window (the engine's, ``heat_window_s``).
To make room, adapters no running request uses leave first, the least heat per page first (a
one-off request's adapter before a hot one, a large cold adapter before a small cold one, as
GreedyDual-Size-Frequency); pinned adapters never. With a seat cap, a tenant already holding its
fair share of the seats may not evict another tenant's hot adapters (the hot set: pinned
adapters and the ``hot_set_size`` hottest); when every seat is taken and an adapter running
requests use is colder than every idle one and frees its seat within ``SOON`` steps, a request
waits for that seat rather than evict a hotter adapter. A request waited on
``max_adapter_wait_s``, a parked running one, or one that finds every seat held by running
requests' adapters and would end before some of them, may also displace adapters running
requests use (once their quantum is over), so none waits forever; when
no request runs, the first one waiting may displace any adapter but a pinned one (an idle engine
keeps no seat for traffic that has not come).

When the pool runs short of empty pages (``lora_guard_cache_evict``), every page that could
leave is valued by what keeping it saves: its expected reuse (requests per second) times what
bringing it back costs (by the engine's own step records: an adapter's write into the pool, a
block's tokens prefilled again), per page; the lowest value leaves first. An adapter's reuse is
its heat over the window. A cached block can be found only by its adapter's requests, so its
reuse is at most its adapter's; a block found often is worth that much, one never found again
since it was cached falls with its age (one pseudo-hit over its age).

``max_loras_per_batch`` caps the distinct adapters of the running requests when set.
``prefill_tokens_per_step`` (default 512) caps the prompt tokens of the new requests one step
starts, in batch form's order (the first always starts, and one waited ``max_adapter_wait_s``):
a burst of prompts starts over a few steps, first come first, rather than all in one long step
that gives each its first token last.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from typing import Any

from lora_guard.plugins import hookimpl
from lora_guard.plugins.decisions import AdapterDecision, Defer
from lora_guard.plugins.eviction import ADAPTER, Candidate
from lora_guard.plugins.options import OptionRegistry, id_list
from lora_guard.plugins.state import EngineState, RequestView, SlotView
from lora_guard.policies.victims import plan_load

FLOOD_SHARE = 2.0  # a tenant running more than this times its share of the batch goes last
PREFILL_TOKENS = 512  # prompt tokens of new requests one step starts, by default
MAX_ADAPTER_WAIT_S = 8.0  # a request waiting this long goes first, by default
SOON = 2  # steps: a request waits for a colder adapter's seat that frees within this many


class HotSetPolicy:
    def __init__(self) -> None:
        self.hot_set_size: int | None = 4  # None: every adapter with heat
        self.seats = 8  # 0: no seat cap
        self.max_loras_per_batch = 0
        self.max_num_seqs = 0  # the engine's, read at configure
        self.max_wait_s = MAX_ADAPTER_WAIT_S
        self.heat_window_s = 60.0
        self.prefill_tokens = PREFILL_TOKENS  # 0: no cap

    @hookimpl
    def lora_guard_add_options(self, options: OptionRegistry) -> None:
        options.add(
            "hot_set_size",
            int,
            None,
            "adapters another tenant at its fair share may not evict, besides pinned ones "
            "(default: slots - 1; every adapter with heat when there is no seat cap)",
        )
        # pin and heat_window_s are read by the engine, which keeps the pins and the heat
        options.add("pin", id_list, (), "adapter ids kept resident once loaded, never evicted")
        options.add(
            "max_loras_per_batch",
            int,
            0,
            "most distinct adapters among running requests (0: no cap; the seats bound each step)",
        )
        options.add(
            "max_adapter_wait_s",
            float,
            MAX_ADAPTER_WAIT_S,
            "a request waiting this long goes ahead of all others and may displace any adapter",
        )
        options.add("heat_window_s", float, 60.0, "sliding window of the heat count, seconds")
        options.add(
            "prefill_tokens_per_step",
            int,
            PREFILL_TOKENS,
            "prompt tokens of new requests one step starts, in batch form's order (the first "
            "always starts; 0: no cap)",
        )

    @hookimpl
    def lora_guard_configure(self, config: dict[str, Any]) -> None:
        self.seats = int(config.get("max_loras", 0))
        size = config.get("hot_set_size")
        if size is not None:
            self.hot_set_size = int(size)
        else:
            self.hot_set_size = max(self.seats - 1, 0) if self.seats else None
        self.max_loras_per_batch = int(config.get("max_loras_per_batch", 0))
        self.max_num_seqs = int(config.get("max_num_seqs", 0))
        self.max_wait_s = float(config.get("max_adapter_wait_s", MAX_ADAPTER_WAIT_S))
        self.prefill_tokens = int(config.get("prefill_tokens_per_step", PREFILL_TOKENS))
        self.heat_window_s = float(config.get("heat_window_s", 60.0))
        if (
            (self.hot_set_size or 0) < 0
            or self.max_loras_per_batch < 0
            or self.prefill_tokens < 0
            or self.max_wait_s <= 0
        ):
            raise ValueError(
                "hot_set_size, max_loras_per_batch and prefill_tokens_per_step must be >= 0, "
                "max_adapter_wait_s > 0"
            )

    def hot_set(self, state: EngineState) -> set[str]:
        hottest = sorted(state.heat, key=lambda a: -state.heat[a])[: self.hot_set_size]
        return set(state.pinned) | set(hottest)

    def aged(self, request: RequestView, state: EngineState) -> bool:
        return state.now - request.arrival_time >= self.max_wait_s

    def victims(self, state: EngineState, request: RequestView, forced: bool) -> list[SlotView]:
        """Adapters that may leave for ``request``'s, in the order they should: those no running
        request uses, least heat per page first; ``forced``, then those too."""
        hot = self.hot_set(state)
        movable = [
            v
            for v in state.slots
            if v.adapter_id is not None
            and v.evictable
            and v.adapter_id not in state.pinned
            and v.adapter_id != request.adapter_id
        ]
        if not forced:
            tenants = {t for t, _ in state.tenant_heat}
            share = math.ceil(max(len(state.slots), 1) / max(len(tenants), 1))
            owners = {v.slot: _owner(state, v.adapter_id) for v in movable}
            held = sum(
                1
                for v in state.slots
                if v.adapter_id and _owner(state, v.adapter_id) == request.tenant_id
            )
            if self.seats and held >= share:
                movable = [
                    v
                    for v in movable
                    if v.adapter_id not in hot or owners[v.slot] in (request.tenant_id, None)
                ]
            movable = [v for v in movable if not v.refs]

        def value(v: SlotView) -> tuple[bool, float, float]:
            return v.refs > 0, self.density(v, state), v.last_used

        return sorted(movable, key=value)

    # the pool's pages
    @hookimpl
    def lora_guard_cache_evict(
        self, candidates: Sequence[Candidate], now: float
    ) -> list[Candidate]:
        window = self.heat_window_s

        def value(c: Candidate) -> tuple[float, float, int]:
            """Milliseconds a second keeping one of its pages saves; then least recent first."""
            if c.kind == ADAPTER:
                rate = c.uses / window
            else:
                rate = (c.uses + 1) / max(now - c.cached_at, 1.0)
                if c.adapter_id is not None:
                    rate = min(rate, c.adapter_uses / window)
            return rate * c.restore_ms / max(c.pages, 1), c.last_used, -c.depth

        return sorted(candidates, key=value)

    # adapter load
    @hookimpl
    def lora_guard_adapter_load(
        self, request: RequestView, tier: str, state: EngineState, parked: bool
    ) -> AdapterDecision | None:
        if tier == "cold" or request.adapter_id is None:
            return None  # reading into host memory needs no seat
        forced = parked or self.aged(request, state) or not state.num_running
        forced = forced or (self.seats_full(state) and self.shorter(request, state))
        victims = self.victims(state, request, forced)
        if self.seats and not state.free_slots and not forced and victims:
            busy = [
                v
                for v in state.slots
                if v.refs and v.adapter_id is not None and v.adapter_id not in state.pinned
            ]
            busy.sort(key=lambda v: self.density(v, state))
            soon = [v for v in busy if state.steps_left.get(v.adapter_id or "", SOON + 1) <= SOON]
            if soon and self.density(soon[0], state) < self.density(victims[0], state):
                # a less used adapter's seat frees within a step or two: wait for it rather
                # than evict a hotter one (waiting longer costs more than a load saves)
                return Defer("a seat of a less used adapter frees soon")
        return plan_load(state, request, victims)

    def density(self, slot: SlotView, state: EngineState) -> float:
        """Requests in the heat window per seat when every seat is taken (the seats bind),
        else per page (the pages do)."""
        heat = state.heat.get(slot.adapter_id or "", 0)
        return heat if self.seats and not state.free_slots else heat / max(slot.pages, 1)

    def seats_full(self, state: EngineState) -> bool:
        """Whether a seat cap binds: every seat holds an adapter running requests use. Then
        adapters take turns at the residency quantum (the engine's ``evictable``), as LoRAX's
        time slices do, rather than a request waiting for whole requests of others to end."""
        return bool(self.seats) and all(v.adapter_id is not None and v.refs for v in state.slots)

    # batch form
    @hookimpl
    def lora_guard_batch_form(
        self, waiting: Sequence[RequestView], running: Sequence[RequestView], state: EngineState
    ) -> list[str]:
        working = {r.adapter_id for r in running if r.adapter_id is not None}
        served = Counter(r.tenant_id for r in running)
        tenants = {r.tenant_id for r in (*running, *waiting)}
        share = FLOOD_SHARE * max(len(running), 1) / max(len(tenants), 1)

        def flooding(tenant: str) -> bool:
            """Running more than twice its share while another tenant has requests."""
            return served[tenant] > share and len(tenants) > 1

        aged = sorted((r for r in waiting if self.aged(r, state)), key=lambda r: r.arrival_time)
        fresh = [r for r in sorted(waiting, key=lambda r: r.arrival_time) if r not in aged]
        cap = self.max_loras_per_batch or math.inf  # 0: no cap
        resident = {v.adapter_id for v in state.slots if v.adapter_id is not None}
        pinned = resident & state.pinned  # their seats are theirs, used or not
        seated = 0  # adapters of this batch that must take a seat
        chosen: list[str] = []
        blocked = False  # an aged request's adapter does not fit yet: no other adapter joins
        draining: set[str] = set()  # adapters whose new requests wait until their seat is free
        later: list[RequestView] = []  # flooding tenants' requests, after everyone else's
        for group in (aged, fresh, later):
            for r in group:
                if r.adapter_id in draining:
                    continue  # its turn comes when its adapter's seat is free
                if group is not later and flooding(r.tenant_id):
                    later.append(r)
                    continue
                if group is later and not self.leaves_places(r, running, chosen, state):
                    continue
                adapter = r.adapter_id
                if (
                    adapter is not None
                    and adapter not in resident
                    and self.in_flight(adapter, state)
                ):
                    # its read from disk decides when it can run: it holds nobody's place meanwhile
                    chosen.append(r.request_id)
                    continue
                joins = adapter is not None and adapter not in working
                if joins:
                    assert adapter is not None
                    seats = self.seats or math.inf  # 0: no seat cap, the pages decide at load
                    under_cap = len(working) < cap
                    fits = under_cap and len(working | pinned | {adapter}) <= seats
                    seats_it = adapter not in resident
                    if fits and seats_it and self.seats:
                        idle = not (running or chosen)  # keeps no seat for traffic to come
                        fits = self.open_seats(state, r, r in aged or idle, working) > seated
                    if not fits or (blocked and r not in aged):
                        if r in aged and not blocked:
                            draining = self.drain_for(state, r, working)
                        blocked = blocked or r in aged
                        if under_cap and not blocked:
                            # only the seats are full: it takes its turn once a seat's quantum
                            # is over (``adapter_load``), as time slices do
                            chosen.append(r.request_id)
                        continue
                    working.add(adapter)
                    seated += seats_it
                chosen.append(r.request_id)
                served[r.tenant_id] += 1
        return self.prefill_cap(chosen, waiting, resident, state)

    def prefill_cap(
        self,
        chosen: list[str],
        waiting: Sequence[RequestView],
        resident: set[str],
        state: EngineState,
    ) -> list[str]:
        """``chosen`` less the requests that would start more than ``prefill_tokens_per_step``
        prompt tokens this step, in order: a burst of prompts starts over a few steps, first come
        first, rather than all in one long step that gives every one of them its first token
        last and stalls the running requests' decodes. The first always starts, and so does a
        request that waited ``max_adapter_wait_s``; a request whose adapter is not resident
        starts no prompt this step (its adapter comes in first) and takes no share."""
        if not self.prefill_tokens:
            return chosen
        by_id = {r.request_id: r for r in waiting}
        kept: list[str] = []
        tokens, full = 0, False
        for request_id in chosen:
            r = by_id[request_id]
            if r.adapter_id is not None and r.adapter_id not in resident:
                kept.append(request_id)
                continue
            n = r.num_prompt_tokens + r.num_output_tokens  # a preempted one computes both again
            full = full or (tokens > 0 and tokens + n > self.prefill_tokens)
            if full and not self.aged(r, state):
                continue
            kept.append(request_id)
            tokens += n
        return kept

    def drain_for(self, state: EngineState, request: RequestView, working: set[str]) -> set[str]:
        """The running adapter whose seat ``request`` (waited on ``max_adapter_wait_s``, its
        adapter kept out) takes once its running requests end: the first it may displace. Its
        new requests wait meanwhile, so the seat frees within one generation even under a
        steady stream for every seated adapter."""
        for v in self.victims(state, request, forced=True):
            if v.refs and v.adapter_id in working:
                return {v.adapter_id}
        return set()

    def open_seats(
        self, state: EngineState, request: RequestView, forced: bool, keep: set[str]
    ) -> int:
        """Seats ``request``'s adapter could take now: free ones, and those of adapters it may
        evict that are not in ``keep`` (the batch being formed)."""
        movable = [v for v in self.victims(state, request, forced) if v.adapter_id not in keep]
        return len(state.free_slots) + len(movable)

    @staticmethod
    def shorter(request: RequestView, state: EngineState) -> bool:
        """Whether ``request`` ends before some seat would free on its own (the engine's
        ``steps_left``; a seat whose end is unknown never frees): then it takes its turn at a
        seat rather than wait for whole longer requests of others; one longer than every
        seated adapter's running requests waits for a seat to free instead of parking them."""
        left = [state.steps_left.get(v.adapter_id or "") for v in state.slots]
        return any(n is None or request.steps_to_end < n for n in left)

    @staticmethod
    def in_flight(adapter: str, state: EngineState) -> bool:
        """Whether ``adapter`` is being read from disk, or must be, beside the steps: its
        requests cannot run before the read ends."""
        cold = adapter not in state.host_adapters and state.reads_in_background
        return adapter in state.loading or cold

    def leaves_places(
        self,
        request: RequestView,
        running: Sequence[RequestView],
        chosen: list[str],
        state: EngineState,
    ) -> bool:
        """Whether a flooding tenant's ``request`` leaves a batch place (``max_num_seqs``) for
        one request of every other tenant with traffic in the heat window."""
        others = len({t for t, _ in state.tenant_heat} - {request.tenant_id})
        busy = len(running) + len(chosen) + 1 + others
        return not (self.max_num_seqs and busy > self.max_num_seqs)


def _owner(state: EngineState, adapter: str | None) -> str | None:
    """The tenant that sends an adapter most of its traffic."""
    best = max(((n, t) for (t, a), n in state.tenant_heat.items() if a == adapter), default=None)
    return best[1] if best else None
