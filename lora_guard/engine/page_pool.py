"""The cache pool's pages, with one owner.

One pool of pages holds KV blocks and adapters' weights (``lora/pool.py`` lays out the memory).
:class:`PagePool` owns all of it: the block manager's accounting (which page is empty, cached or
held by a request), the memory, and the adapter region: pages ``[0, top)``, one run per resident
adapter, packed without holes. The scheduler owns the page pool and takes KV blocks from it; the
residency manager asks it to place an adapter (pages claimed at the top, KV blocks moved out of
the way) and to remove one (the runs above move down).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from lora_guard.engine.kv_cache import BlockManager
from lora_guard.engine.lora.checkpoint import LoRAAdapter
from lora_guard.engine.lora.pool import AdapterLayout, CachePool, LayerWeights
from lora_guard.engine.sequence import Sequence


@dataclass(eq=False)
class AdapterRun:
    """An adapter's pages ``[first_page, first_page + num_pages)`` and its weights' views there
    (made again when the run moves)."""

    first_page: int
    layout: AdapterLayout
    layers: list[LayerWeights]

    @property
    def num_pages(self) -> int:
        return self.layout.num_pages


class PagePool:
    """KV blocks and adapter runs in one pool of pages (see above)."""

    def __init__(self, memory: CachePool, blocks: BlockManager) -> None:
        self.memory, self.blocks = memory, blocks
        self.runs: list[AdapterRun] = []  # from the bottom up
        self.top = 0  # pages [0, top) hold adapters
        self._layouts: dict[str, AdapterLayout] = {}  # by content hash

    @property
    def partitioned(self) -> bool:
        """Whether adapters have pages of their own (``adapter_memory``) that KV never takes."""
        return self.blocks.kv_pages is not None and self.blocks.kv_pages < self.blocks.num_blocks

    @property
    def adapter_region(self) -> int:
        """Pages adapters may hold together."""
        blocks = self.blocks
        return blocks.num_blocks - (blocks.kv_pages or 0) if self.partitioned else blocks.num_blocks

    def blank(self, freed: int = 0) -> int:
        """Pages an adapter could take now with runs of ``freed`` pages gone, nothing else
        leaving."""
        if self.partitioned:
            return self.adapter_region - len(self.blocks.reserved) + freed
        return self.blocks.num_blank_pages + freed

    def occupancy(self) -> dict[str, Any]:
        """How the pages are used now, as the hooks' ``EngineState`` reads it."""
        blocks = self.blocks
        page_bytes = self.memory.nbytes() // blocks.num_blocks
        return dict(
            memory_watermark=1 - blocks.num_free_blocks / blocks.num_blocks,
            kv_share=blocks.num_used_blocks / blocks.num_blocks,
            pool_bytes=MappingProxyType(
                {
                    "kv": blocks.num_used_blocks * page_bytes,
                    "adapter": len(blocks.reserved) * page_bytes,
                    "free": blocks.num_free_blocks * page_bytes,
                }
            ),
            free_pages=blocks.num_free_blocks,
            pool_pages=blocks.num_blocks,
            block_size=blocks.block_size,
        )

    def layout(self, adapter: LoRAAdapter) -> AdapterLayout:
        """Where ``adapter``'s matrices sit in a run of pages (the same for every copy)."""
        layout = self._layouts.get(adapter.content_hash)
        if layout is None:
            layout = self._layouts[adapter.content_hash] = self.memory.layout(adapter)
        return layout

    def place(self, adapter: LoRAAdapter, holders: Iterable[Sequence]) -> AdapterRun:
        """Write ``adapter`` at the top of the adapter region. The KV blocks on those pages move
        to empty ones (``holders``, the sequences holding blocks, follow them); the caller has
        made the pages blank or free first."""
        layout = self.layout(adapter)
        first = self.top
        for src, dst in self.blocks.claim(range(first, first + layout.num_pages), holders):
            self.memory.copy_page(src, dst)
        self.top += layout.num_pages
        self.memory.write(adapter, layout, first)
        run = AdapterRun(first, layout, self.memory.views(layout, first))
        self.runs.append(run)
        return run

    def remove(self, run: AdapterRun) -> None:
        """Give ``run``'s pages back; the runs above it move down so no hole is left."""
        n = run.num_pages
        self.runs.remove(run)
        for other in self.runs:  # from the bottom up: each moves into room already made
            if other.first_page > run.first_page:
                self.memory.move_pages(other.first_page, other.first_page - n, other.num_pages)
                other.first_page -= n
                other.layers = self.memory.views(other.layout, other.first_page)
        self.top -= n
        self.blocks.release_pages(range(self.top, self.top + n))
