"""Clairvoyant eviction: a reference that knows the whole trace.

When the pool needs pages, what leaves is what the trace needs again last (Belady's rule, over
adapters and cached prefix blocks alike): an adapter by the next arrival of a request for it, a
cached block by the next request of its adapter whose prompt holds the same tokens at the same
place in its chain. Requests already waiting count as needing theirs now. Batches are the
engine's default (first come first served), so the reference answers one question: what an
eviction order could gain on this pool if it knew the future. It is not an optimum of TTFT:
Belady's rule is optimal for hits of equal cost and size, and the pool's candidates differ in
both.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Sequence
from typing import Any

from lora_guard.plugins import hookimpl
from lora_guard.plugins.eviction import ADAPTER, Candidate
from lora_guard.workload.trace import TraceRequest

#: (adapter, place in the chain, the block's tokens): what finds a cached block
Chunk = tuple[str | None, int, tuple[int, ...]]


class ClairvoyantEviction:
    """Orders the pool's candidates by their next use in ``trace``, latest first."""

    def __init__(
        self,
        engine: Any,
        trace: Sequence[TraceRequest],
        encode: Callable[[str], list[int]],
        start: float,
    ) -> None:
        self.scheduler, self.start = engine.scheduler, start
        self.size = self.scheduler.blocks.block_size
        self.adapter_times: dict[str | None, list[float]] = {}
        self.chunk_times: dict[Chunk, list[float]] = {}
        for r in sorted(trace, key=lambda r: r.time):
            self.adapter_times.setdefault(r.adapter_id, []).append(r.time)
            for chunk in self.chunks(r.adapter_id, encode(r.prompt)):
                self.chunk_times.setdefault(chunk, []).append(r.time)

    def chunks(self, adapter: str | None, tokens: Sequence[int]) -> list[Chunk]:
        n = self.size
        return [(adapter, i, tuple(tokens[i * n : (i + 1) * n])) for i in range(len(tokens) // n)]

    @hookimpl(tryfirst=True)
    def lora_guard_cache_evict(
        self, candidates: Sequence[Candidate], now: float
    ) -> list[Candidate]:
        t = now - self.start
        waiting = [*self.scheduler.waiting, *self.scheduler.running]
        needed = {c for s in waiting for c in self.chunks(s.adapter_id, s.token_ids)}
        blocks = self.scheduler.blocks.blocks

        def next_use(c: Candidate) -> float:
            if c.kind == ADAPTER:
                times = self.adapter_times.get(c.adapter_id, [])
            else:
                chunk = (c.adapter_id, c.depth, blocks[c.key].token_ids)
                if chunk in needed:
                    return t
                times = self.chunk_times.get(chunk, [])
            i = bisect.bisect_right(times, t)
            return times[i] if i < len(times) else math.inf

        return sorted(candidates, key=lambda c: (-next_use(c), c.last_used))
