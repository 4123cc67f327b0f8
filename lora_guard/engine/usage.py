"""How adapters are used, kept once by the engine: pins, heat (requests per tenant and adapter)
and the recent loads. The state view shows them to the policies, read-only; the admin routes
change pins through :meth:`AdapterUsage.pin` on the engine thread.

:class:`SlidingWindow` is the one sliding window of the project: the engine's heat and load
counts and the metrics' ratios are all made of it.
"""

from __future__ import annotations

import threading
from collections import Counter, deque
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

from lora_guard.clock import monotonic
from lora_guard.plugins.state import LOAD_WINDOW_S as WINDOW_S  # the heat's: ``heat_window_s``

K = TypeVar("K", bound=Hashable)


class SlidingWindow(Generic[K]):
    """Events of the last ``window_s`` seconds, each with a key, counted by key.

    Events are added in time order. Thread-safe: the engine thread adds, a scrape thread may read.
    """

    def __init__(self, window_s: float, clock: Callable[[], float] = monotonic) -> None:
        self.window_s = window_s
        self._clock = clock
        self._events: deque[tuple[float, K]] = deque()
        self._counts: Counter[K] = Counter()  # keys stay, at 0, in the order first seen
        self._lock = threading.Lock()

    def add(self, key: K) -> None:
        with self._lock:
            self._events.append((self._clock(), key))
            self._counts[key] += 1
            self._expire(None)  # bounded even if nobody reads

    def counts(self, now: float | None = None) -> dict[K, int]:
        """Events per key in the window ending at ``now`` (default: the clock), keys in the
        order first seen."""
        with self._lock:
            self._expire(now)
            return {k: n for k, n in self._counts.items() if n > 0}

    def times(self, now: float | None = None) -> tuple[float, ...]:
        """When each event in the window happened, oldest first."""
        with self._lock:
            self._expire(now)
            return tuple(t for t, _ in self._events)

    def total(self, now: float | None = None) -> int:
        with self._lock:
            self._expire(now)
            return len(self._events)

    def share(self, key: K, now: float | None = None) -> float:
        """The share of the window's events with ``key``; 0.0 (never NaN) when it is empty."""
        with self._lock:
            self._expire(now)
            return self._counts[key] / len(self._events) if self._events else 0.0

    def _expire(self, now: float | None) -> None:
        horizon = (self._clock() if now is None else now) - self.window_s
        events = self._events
        while events and events[0][0] <= horizon:
            self._counts[events.popleft()[1]] -= 1


class AdapterUsage:
    """Pins, heat and recent loads of one engine's adapters."""

    def __init__(
        self,
        max_loras: int,
        heat_window_s: float = WINDOW_S,
        clock: Callable[[], float] = monotonic,
    ) -> None:
        self.max_loras = max_loras  # 0: no seat cap
        self.pinned: tuple[str, ...] = ()  # in the order pinned
        self.arrivals: SlidingWindow[tuple[str, str]] = SlidingWindow(heat_window_s, clock)
        self.disk_reads: SlidingWindow[str] = SlidingWindow(WINDOW_S, clock)
        # loads that evicted an adapter requests still needed, made for a request not running
        # yet (a parked request's reload is paced by the residency quantum)
        self.evicting_loads: SlidingWindow[str] = SlidingWindow(WINDOW_S, clock)

    # pins
    def pin(self, *adapter_ids: str) -> None:
        """Keep adapters resident once loaded; at least one seat stays for the others."""
        for adapter_id in adapter_ids:
            if adapter_id in self.pinned:
                continue
            if self.max_loras and len(self.pinned) + 1 >= self.max_loras:
                raise ValueError(
                    f"pinning {adapter_id!r} would leave no slot for the other adapters "
                    f"({self.max_loras} slots)"
                )
            self.pinned = (*self.pinned, adapter_id)

    def unpin(self, adapter_id: str) -> None:
        self.pinned = tuple(a for a in self.pinned if a != adapter_id)

    # heat
    def arrived(self, tenant_id: str, adapter_id: str) -> None:
        self.arrivals.add((tenant_id, adapter_id))

    def tenant_heat(self, now: float | None = None) -> dict[tuple[str, str], int]:
        """Requests per (tenant, adapter) that arrived in the heat window."""
        return self.arrivals.counts(now)

    def heat(self, now: float | None = None) -> dict[str, int]:
        """Requests per adapter that arrived in the heat window."""
        heat: Counter[str] = Counter()
        for (_, adapter_id), n in self.arrivals.counts(now).items():
            heat[adapter_id] += n
        return dict(heat)
