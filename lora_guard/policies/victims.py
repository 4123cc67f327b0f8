"""Which resident adapters leave, and how many.

Every seat-choosing policy (the rivals' eviction orders and lora-guard's hot set) calls
:func:`plan_load`: it takes a free seat, or the first victim's seat, and as many victims, in the
policy's order, as the adapter's pages need beyond the free pages. A policy only decides the
order; this module decides how many go.

When no policy decides, the residency manager and the simulator both take the engine's own
choice, written once here over plain views of the residents (:class:`ResidentView`): which may
leave now (:func:`may_leave`) and in what order (:func:`eviction_order`, :func:`kv_order`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Generic, TypeVar

from lora_guard.plugins.decisions import Defer, Load
from lora_guard.plugins.state import EngineState, RequestView, SlotView

Resident = TypeVar("Resident")


@dataclass(frozen=True, slots=True)
class ResidentView(Generic[Resident]):
    """What the engine's victim choice knows of one resident adapter."""

    resident: Resident
    last_used: float
    loaded_at: float
    needed: bool = False  # requests, running or waiting, need its weights
    held: bool = False  # may not leave whatever its age: pinned, or computed with right now


def may_leave(view: ResidentView[Resident], now: float, quantum_s: float) -> bool:
    """Whether the engine lets ``view`` leave now: not held, and either no request needs it or it
    has been resident for its quantum."""
    return not view.held and (not view.needed or now - view.loaded_at >= quantum_s)


def eviction_order(
    views: Iterable[ResidentView[Resident]], now: float, quantum_s: float
) -> list[Resident]:
    """The residents that may leave now, in the engine's order: those no request needs first,
    then the others, least recently used first within each."""
    leaving = [v for v in views if may_leave(v, now, quantum_s)]
    return [v.resident for v in sorted(leaving, key=lambda v: (v.needed, v.last_used))]


def kv_order(views: Iterable[ResidentView[Resident]]) -> list[Resident]:
    """The residents that may give their pages to KV in use, least recently used first: KV in use
    outranks the quantum and the requests that need them, which wait."""
    return [v.resident for v in sorted((v for v in views if not v.held), key=lambda v: v.last_used)]


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
