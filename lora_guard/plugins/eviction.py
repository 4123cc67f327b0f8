"""What leaves the cache pool, decided in one place.

The pool's pages hold three things besides free space: KV blocks in use, cached prefix blocks no
request holds (kept for reuse), and adapter weights. When KV or an adapter needs pages and the
empty ones are too few, something that could give pages back leaves: a cached prefix block or a
resident adapter. Every such choice goes through :func:`choose`: the engine builds a
:class:`Candidate` for each, asks the ``lora_guard_cache_evict`` hook for an order (the engine's
default when no plugin answers: :func:`lru`, least recently used first over both kinds, as
S-LoRA's unified pool does), and takes candidates in that order until enough pages are free.

Which adapters may leave at all, and in what order when only adapters compete for a seat, is
here too (:class:`ResidentView`, :func:`may_leave`, :func:`eviction_order`, :func:`kv_order`),
written once over plain views so the engine, the policies, the simulator and the vLLM seat model
share it.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Generic, Literal, TypeVar

Resident = TypeVar("Resident")

ADAPTER: Literal["adapter"] = "adapter"
PREFIX: Literal["prefix"] = "prefix"


@dataclass(frozen=True, slots=True)
class Candidate:
    """Something in the pool that could give its pages back now.

    :param kind: ``"adapter"`` (a resident adapter no step is computing with) or ``"prefix"``
        (a cached prefix block no request holds).
    :param key: the adapter's seat, or the block's page number.
    :param pages: pages it gives back.
    :param last_used: the engine's clock when a step last computed with it (an adapter), or
        when a request last held or found it (a block).
    :param uses: requests for the adapter in the heat window (an adapter); times a request found
        the block in the cache since it was cached (a block).
    :param restore_ms: what bringing it back would cost, by the engine's own step records: the
        adapter's write into the pool (and its read from disk when host memory does not hold
        it), or the block's tokens prefilled again.
    :param adapter_id: the adapter (an adapter), or the adapter whose weights computed the block
        (None: the base model).
    :param depth: the block's place in its prefix chain (0: the first block); 0 for an adapter.
    :param cached_at: when the block was cached, or the adapter loaded.
    :param adapter_uses: requests for its adapter in the heat window (a block of an adapter's
        KV: only that adapter's requests can find it).
    """

    kind: Literal["adapter", "prefix"]
    key: Hashable
    pages: int
    last_used: float
    uses: int = 0
    restore_ms: float = 0.0
    adapter_id: str | None = None
    depth: int = 0
    cached_at: float = 0.0
    adapter_uses: int = 0


Order = Callable[[Sequence[Candidate]], Sequence[Candidate] | None]


def lru(candidates: Iterable[Candidate]) -> list[Candidate]:
    """The engine's default: least recently used first, over adapters and prefix blocks alike;
    among blocks used at the same moment, the deepest first (a chain's tail before its head)."""
    return sorted(candidates, key=lambda c: (c.last_used, -c.depth))


def choose(candidates: Sequence[Candidate], pages: int, order: Order | None) -> list[Candidate]:
    """Candidates that free at least ``pages`` pages, taken in ``order``'s order (the hook's
    answer: candidates, most expendable first; those it leaves out stay), or :func:`lru`'s when
    it has none. Fewer pages than asked when the order runs out."""
    if pages <= 0 or not candidates:
        return []
    ranked = order(candidates) if order is not None else None
    if ranked is None:
        ranked = lru(candidates)
    offered = set(candidates)
    chosen: list[Candidate] = []
    freed = 0
    for candidate in dict.fromkeys(ranked):
        if freed >= pages:
            break
        if candidate in offered:
            chosen.append(candidate)
            freed += candidate.pages
    return chosen


# adapters among themselves: seats, and the order when only adapters compete


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
