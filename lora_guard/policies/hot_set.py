"""Hot-set admission: keep the adapters with the most traffic resident, and form batches that
hit them.

Heat is the number of requests per (tenant, adapter) over a sliding window. The hot set is the
pinned adapters (``pin``) plus the ``hot_set_size`` hottest (default: all seats but one, which
serves the cold tail; with no seat cap, every adapter with heat, and the pool's pages decide). A
warm adapter takes a free seat in the pool, else the seat of the least recently used adapter
outside the hot set that the engine lets leave now (its residency quantum over, or no request
needing it); a hot adapter is displaced only by another hot one, a pinned one never. A tenant
already holding its fair share of the seats may not evict another tenant's hot adapters (its own,
and other tenants' cold ones, it may). A request that has waited
``max_wait_steps``, or a running one whose adapter left the pool (parked), may displace any
adapter that is not pinned, so none waits for a seat forever.

Batch form offers requests whose adapter is resident first, then the others hottest first, aged
requests ahead of all. It admits a request whose adapter has no seat yet: the engine rotates
seats at step boundaries, so the request waits for a residency quantum, not for another
request's whole life. ``max_loras_per_batch`` caps the distinct adapters of the running requests
when set.

The engine keeps the heat and the pins (``EngineState.heat``, ``tenant_heat``, ``pinned``); this
policy reads them and decides.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from lora_guard.plugins import Defer, Load, hookimpl
from lora_guard.plugins.decisions import AdapterDecision
from lora_guard.plugins.options import OptionRegistry, id_list
from lora_guard.plugins.state import EngineState, RequestView


class HotSetPolicy:
    def __init__(self) -> None:
        self.hot_set_size: int | None = 4  # None: every adapter with heat
        self.seats = 8  # 0: no seat cap
        self.max_loras_per_batch = 0
        self.max_wait_steps = 16

    @hookimpl
    def lora_guard_add_options(self, options: OptionRegistry) -> None:
        options.add(
            "hot_set_size", int, None,
            "adapters kept resident by heat, besides pinned ones (default: slots - 1)",
        )  # fmt: skip
        # pin and heat_window_s are read by the engine, which keeps the pins and the heat
        options.add("pin", id_list, (), "adapter ids kept resident once loaded, never evicted")
        options.add(
            "max_loras_per_batch",
            int,
            0,
            "most distinct adapters among running requests (0: no cap; the seats bound each step)",
        )
        options.add(
            "max_wait_steps", int, 16, "a request waiting this many steps goes ahead of all others"
        )
        options.add("heat_window_s", float, 60.0, "sliding window of the heat count, seconds")

    @hookimpl
    def lora_guard_configure(self, config: dict[str, Any]) -> None:
        self.seats = int(config.get("max_loras", 0))
        size = config.get("hot_set_size")
        if size is not None:
            self.hot_set_size = int(size)
        else:
            self.hot_set_size = max(self.seats - 1, 0) if self.seats else None
        self.max_loras_per_batch = int(config.get("max_loras_per_batch", 0))
        self.max_wait_steps = int(config.get("max_wait_steps", 16))
        if (self.hot_set_size or 0) < 0 or self.max_loras_per_batch < 0 or self.max_wait_steps < 1:
            raise ValueError("hot_set_size and max_loras_per_batch must be >= 0, "
                             "max_wait_steps >= 1")  # fmt: skip

    def hot_set(self, state: EngineState) -> set[str]:
        hottest = sorted(state.heat, key=lambda a: -state.heat[a])[: self.hot_set_size]
        return set(state.pinned) | set(hottest)

    # adapter load
    @hookimpl
    def lora_guard_adapter_load(
        self, request: RequestView, tier: str, state: EngineState, parked: bool
    ) -> AdapterDecision | None:
        if tier == "cold":
            return None  # reading into host memory needs no seat
        if state.free_slots:
            return Load(state.free_slots[0])
        hot = self.hot_set(state)
        aged = parked or request.waited_steps >= self.max_wait_steps
        idle = [v for v in state.slots if v.evictable and v.adapter_id not in state.pinned]
        candidates = [v for v in idle if v.adapter_id not in hot]
        if not candidates and (request.adapter_id in hot or aged):
            candidates = idle  # a hot adapter, or one waited on too long, may displace a hot one
        if not aged:
            tenants = {t for t, _ in state.tenant_heat}
            fair_share = math.ceil(len(state.slots) / max(len(tenants), 1))
            owners = {v.slot: _owner(state, v.adapter_id) for v in state.slots if v.adapter_id}
            if sum(1 for o in owners.values() if o == request.tenant_id) >= fair_share:
                candidates = [
                    v
                    for v in candidates
                    if owners.get(v.slot) in (request.tenant_id, None) or v.adapter_id not in hot
                ]
        if not candidates:
            return Defer("no slot may be evicted for this adapter now")
        victim = min(candidates, key=lambda v: v.last_used)
        return Load(victim.slot)

    # batch form
    @hookimpl
    def lora_guard_batch_form(
        self, waiting: Sequence[RequestView], running: Sequence[RequestView], state: EngineState
    ) -> list[str]:
        resident = {v.adapter_id for v in state.slots if v.adapter_id is not None}
        aged = [r for r in waiting if r.waited_steps >= self.max_wait_steps]
        ready = [
            r
            for r in waiting
            if r not in aged and (r.adapter_id is None or r.adapter_id in resident)
        ]
        rest = [r for r in waiting if r not in aged and r not in ready]
        hot = self.hot_set(state)
        rest.sort(key=lambda r: (r.adapter_id not in hot, -state.heat.get(r.adapter_id or "", 0)))
        cap = self.max_loras_per_batch or math.inf  # 0: no cap
        adapters = {r.adapter_id for r in running if r.adapter_id is not None}
        chosen = []
        for r in [*aged, *ready, *rest]:
            if r.adapter_id is not None and r.adapter_id not in adapters:
                if len(adapters) >= cap and r not in aged:
                    continue
                adapters.add(r.adapter_id)
            chosen.append(r.request_id)
        return chosen


def _owner(state: EngineState, adapter: str) -> str | None:
    """The tenant that sends an adapter most of its traffic."""
    best = max(((n, t) for (t, a), n in state.tenant_heat.items() if a == adapter), default=None)
    return best[1] if best else None
