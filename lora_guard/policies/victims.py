"""Which resident adapters leave, and how many.

Every seat-choosing policy (the rivals' eviction orders and lora-guard's hot set) calls
:func:`plan_load`: it takes a free seat, or the first victim's seat, and as many victims, in the
policy's order, as the adapter's pages need beyond the free pages. A policy only decides the
order; this module decides how many go.

The engine's own choice, when no policy decides, is ``lora_guard.plugins.eviction``'s.
"""

from __future__ import annotations

from collections.abc import Iterable

from lora_guard.plugins.decisions import Defer, Load
from lora_guard.plugins.state import EngineState, RequestView, SlotView


def idle_residents(state: EngineState) -> list[SlotView]:
    """Resident adapters no running request uses that the engine lets leave now: what vLLM and
    SGLang may evict (an adapter in the running batch stays)."""
    return [v for v in state.slots if v.adapter_id is not None and v.evictable and not v.refs]


def plan_load(state: EngineState, request: RequestView, order: Iterable[SlotView]) -> Load | Defer:
    """Seat and victims for ``request``'s adapter: a free seat and the free pages if they
    suffice, else victims taken from ``order`` until they do. Defer when ``order`` cannot free
    enough."""
    need = state.adapter_pages.get(request.adapter_id or "", 0)
    seat = state.free_slots[0] if state.free_slots else None
    room, chosen = state.free_pages, list[SlotView]()
    for victim in order:
        if seat is not None and room >= need:
            break
        chosen.append(victim)
        room += victim.pages
        if seat is None:
            seat = victim.slot
    if seat is None or room < need:
        return Defer("no room can be freed for this adapter now")
    return Load(seat, tuple(v.slot for v in chosen if v.slot != seat))
