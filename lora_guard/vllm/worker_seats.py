"""vLLM's worker's adapter seats, as the scheduler follows them from the batches it forms.

vLLM's worker keeps the adapters of the last batches in ``max_loras`` device seats and
``max_cpu_loras`` host slots, least recently used leaving first; :class:`Seats` follows the same
rule (the engine's own eviction order, ``plugins.eviction``), so a lookup's tier (hot, warm,
cold) is the worker's.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from lora_guard.plugins.eviction import ResidentView, eviction_order


class Seats:
    """Adapters in a fixed number of seats, the least recently used leaving for a new one."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.seat_of: OrderedDict[str, int] = OrderedDict()  # least recently used first
        self.last_used: dict[str, float] = {}
        self.loaded_at: dict[str, float] = {}

    def use(self, adapters: Iterable[str], now: float) -> list[tuple[str, int, str | None]]:
        """Seat ``adapters`` (one batch); returns each load as (adapter, seat, adapter evicted)."""
        batch = sorted(set(adapters))
        loads = []
        for adapter in batch:
            self.last_used[adapter] = now
            if adapter in self.seat_of:
                self.seat_of.move_to_end(adapter)
                continue
            evicted = None
            if len(self.seat_of) < self.size:
                seat = min(set(range(self.size)) - set(self.seat_of.values()))
            else:
                views = [
                    ResidentView(a, self.last_used[a], self.loaded_at[a], held=a in batch)
                    for a in self.seat_of
                ]
                order = eviction_order(views, now, quantum_s=0.0)  # the engine's own rule
                evicted = order[0] if order else None
                if evicted is None:
                    continue  # more adapters than seats in one batch: vLLM's gate forbids it
                seat = self.seat_of.pop(evicted)
            self.seat_of[adapter] = seat
            self.loaded_at[adapter] = now
            loads.append((adapter, seat, evicted))
        return loads

    def full(self) -> bool:
        return len(self.seat_of) >= self.size


@dataclass
class Load:
    """An adapter the worker loads in the step being run."""

    adapter_id: str
    seat: int
    tier: str  # warm: from host memory; cold: read from disk
    evicted: str | None
