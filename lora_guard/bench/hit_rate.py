"""Adapter hit rates on a trace: Zipf traces and the offline optimum (Belady) for a slot count."""

from __future__ import annotations

import math
import random
from collections.abc import Sequence


def zipf_trace(num_adapters: int, length: int, exponent: float = 1.0, seed: int = 0) -> list[int]:
    """Adapter indices drawn with Zipf popularity: adapter ``i`` has weight ``1 / (i+1)**s``."""
    rng = random.Random(seed)
    weights = [1 / (i + 1) ** exponent for i in range(num_adapters)]
    return rng.choices(range(num_adapters), weights=weights, k=length)


def belady_hit_rate(trace: Sequence[object], slots: int) -> float:
    """Hit rate of the optimal offline policy: on a miss, evict the adapter used furthest ahead."""
    if not trace:
        return 0.0
    next_use: list[float] = [0.0] * len(trace)
    last: dict[object, float] = {}
    for i in range(len(trace) - 1, -1, -1):
        next_use[i] = last.get(trace[i], math.inf)
        last[trace[i]] = i
    resident: dict[object, float] = {}
    hits = 0
    for i, adapter in enumerate(trace):
        if adapter in resident:
            hits += 1
        elif len(resident) >= slots:
            del resident[max(resident, key=resident.__getitem__)]
        resident[adapter] = next_use[i]
    return hits / len(trace)
