"""Paged KV cache: one preallocated pool of fixed-size blocks, block tables, prefix caching.

A full block is keyed by a chained hash of (parent key, namespace, its token ids). The namespace
keeps blocks of different adapters (and, by policy, tenants) apart: the default is the request's
scope. Each block also records its scope (``CacheScope``: base model id, adapter id, adapter
content hash), the weights that computed it. Every hit is verified: tokens
and namespace must match, and a hit whose scope differs from the request's is a conflict, counted
and refused unless the caller's ``may_reuse`` allows it (an explicit observe mode that shows the
hazard). Free
blocks that still hold cached content are reused least-recently-freed first.

The blocks are the pages of the cache pool (``engine/lora/pool.py``): pages that hold adapter
weights are reserved here, out of the KV's reach, and a KV block in a page an adapter needs is
moved to another page (``claim``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Collection, Hashable, Iterable
from dataclasses import dataclass, field

import torch

from lora_guard.clock import monotonic
from lora_guard.engine.sequence import CacheScope, Sequence


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    key: int | None = None
    token_ids: tuple[int, ...] = ()
    namespace: Hashable = None
    scope: CacheScope | None = None  # the weights that computed it
    depth: int = 0  # its place in its prefix chain
    cached_at: float = 0.0
    last_used: float = 0.0  # when a request last held or found it
    hits: int = 0  # requests that found it cached


def block_key(parent: int | None, namespace: Hashable, token_ids: tuple[int, ...]) -> int:
    return hash(("lora-guard/kv/v1", parent, namespace, token_ids))


@dataclass(slots=True)
class CacheStats:
    queried_tokens: int = 0
    hit_tokens: int = 0
    conflicts: int = 0
    copies_on_write: int = 0


ReuseCheck = Callable[[Block, Sequence], bool]


@dataclass
class KVCache:
    """The KV tensors: per layer, keys and values of ``num_blocks * block_size`` token slots."""

    k: torch.Tensor  # [layers, num_blocks * block_size, kv_heads, head_dim]
    v: torch.Tensor

    @classmethod
    def zeros(
        cls,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> KVCache:
        shape = (num_layers, num_blocks * block_size, kv_heads, head_dim)
        return cls(
            torch.zeros(shape, dtype=dtype, device=device),
            torch.zeros(shape, dtype=dtype, device=device),
        )

    @staticmethod
    def bytes_per_block(
        num_layers: int, block_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        return 2 * num_layers * block_size * kv_heads * head_dim * dtype.itemsize

    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()

    def copy_block(self, src: int, dst: int, block_size: int) -> None:
        s = slice(src * block_size, (src + 1) * block_size)
        d = slice(dst * block_size, (dst + 1) * block_size)
        self.k[:, d] = self.k[:, s]
        self.v[:, d] = self.v[:, s]


@dataclass
class BlockManager:
    """Owns the block pool's bookkeeping; the tensors live in :class:`KVCache`."""

    num_blocks: int
    block_size: int
    enable_prefix_caching: bool = True
    stats: CacheStats = field(default_factory=CacheStats)
    clock: Callable[[], float] = monotonic
    kv_pages: int | None = None  # most pages KV may hold, cached blocks included (None: all)

    def __post_init__(self) -> None:
        self.blocks = [Block(i) for i in range(self.num_blocks)]
        # Highest pages first: adapter weights take pages from the bottom of the pool up.
        self._empty: OrderedDict[int, None] = OrderedDict(
            (i, None) for i in reversed(range(self.num_blocks))
        )
        self._idle: OrderedDict[int, None] = OrderedDict()  # cached, free: least recent first
        self.cached: dict[int, int] = {}
        self.pending_copies: list[tuple[int, int]] = []
        self.reserved: set[int] = set()  # pages holding adapter weights

    @property
    def num_free_blocks(self) -> int:
        """Pages KV can take now: empty ones and those of cached blocks no request holds (within
        ``kv_pages``, when the pool keeps the rest for adapters)."""
        free = len(self._empty) + len(self._idle)
        if self.kv_pages is None:
            return free
        return min(free, self.kv_pages - self.num_used_blocks)

    @property
    def num_kv_pages(self) -> int:
        """Pages KV holds: blocks in use and cached blocks no request holds."""
        return self.num_used_blocks + len(self._idle)

    @property
    def num_empty_blocks(self) -> int:
        """Empty pages KV may take now (within ``kv_pages``)."""
        if self.kv_pages is None:
            return len(self._empty)
        return max(min(len(self._empty), self.kv_pages - self.num_kv_pages), 0)

    @property
    def num_blank_pages(self) -> int:
        """Empty pages, whoever may take them."""
        return len(self._empty)

    def idle_cached(self, protect: Collection[int] = ()) -> list[Block]:
        """Cached blocks no request holds (``protect`` left out), least recently used first."""
        return [self.blocks[b] for b in self._idle if b not in protect]

    def drop(self, block_id: int) -> None:
        """Forget a cached block no request holds: its page becomes empty."""
        assert block_id in self._idle, f"block {block_id} is not a free cached block"
        del self._idle[block_id]
        self._forget(block_id)
        self._empty[block_id] = None

    @property
    def num_used_blocks(self) -> int:
        """KV blocks held by sequences (adapter pages not counted)."""
        return self.num_blocks - len(self._empty) - len(self._idle) - len(self.reserved)

    # pages for adapters
    def claim(self, pages: Iterable[int], holders: Iterable[Sequence]) -> list[tuple[int, int]]:
        """Reserve ``pages`` for adapter weights. A KV block in use there moves to a free page
        (``holders``' block tables follow it), and so does a cached block while empty pages
        remain; returns the (from, to) page copies to make before the pages are written. The
        caller checks that enough pages are free."""
        assert not self.pending_copies, "claim pages before this step's copies are planned"
        wanted = list(pages)
        in_use, idle = [], []
        for page in wanted:
            assert page not in self.reserved, f"page {page} is reserved already"
            if self.blocks[page].ref_count:
                in_use.append(page)
                continue
            if page in self._idle:
                del self._idle[page]
                idle.append(page)
            else:
                del self._empty[page]
            self.reserved.add(page)
        assert len(in_use) <= self.num_free_blocks, "not enough free pages to move KV blocks"
        moves = []
        tables = [seq.block_table for seq in holders]
        for page in in_use:
            if self._empty:  # moving a block in use leaves the KV's share as it was
                dst, _ = self._empty.popitem(last=False)
            else:
                dst = self._fresh_page()
            self._move(page, dst)
            for table in tables:
                for i, block_id in enumerate(table):
                    if block_id == page:
                        table[i] = dst
            self.reserved.add(page)
            moves.append((page, dst))
        kept = False
        for page in idle:
            if self._empty:
                dst, _ = self._empty.popitem(last=False)
                self._move(page, dst)
                self._idle[dst] = None
                moves.append((page, dst))
                kept = True
            else:
                self._forget(page)
        if kept:  # the moved blocks back in their places, least recently used first
            order = sorted(self._idle, key=lambda b: self.blocks[b].last_used)
            self._idle = OrderedDict.fromkeys(order)
        return moves

    def _move(self, page: int, dst: int) -> None:
        """Move the block in ``page`` to the free page ``dst``; ``page`` is left blank."""
        old, new = self.blocks[page], self.blocks[dst]
        new.ref_count, new.key, new.token_ids = old.ref_count, old.key, old.token_ids
        new.namespace, new.scope, new.depth = old.namespace, old.scope, old.depth
        new.cached_at, new.last_used, new.hits = old.cached_at, old.last_used, old.hits
        if old.key is not None and self.cached.get(old.key) == page:
            self.cached[old.key] = dst
        self.blocks[page] = Block(page)

    def release_pages(self, pages: Iterable[int]) -> None:
        """Give pages that held adapter weights back to the KV."""
        for page in pages:
            self.reserved.remove(page)
            self._empty[page] = None

    def demote(self, scope_matches: Callable[[CacheScope | None], bool]) -> None:
        """Make the free cached blocks whose scope matches the first to be reused, as if never
        used (their weights left the pool: they serve nobody until those come back)."""
        for block_id in [b for b in self._idle if scope_matches(self.blocks[b].scope)]:
            self.blocks[block_id].last_used = float("-inf")
            self._idle.move_to_end(block_id, last=False)

    def _forget(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.key is not None and self.cached.get(block.key) == block_id:
            del self.cached[block.key]
        block.key, block.token_ids, block.namespace, block.scope = None, (), None, None
        block.depth, block.hits = 0, 0

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # prefix cache
    def _find_prefix(
        self, seq: Sequence, may_reuse: ReuseCheck | None, *, record: bool
    ) -> list[int]:
        """Cached blocks that hold a prefix of ``seq``'s tokens in its namespace."""
        if not self.enable_prefix_caching:
            return []
        hits: list[int] = []
        bs, parent, tokens = self.block_size, None, seq.token_ids
        for i in range(len(tokens) // bs):
            chunk = tuple(tokens[i * bs : (i + 1) * bs])
            key = block_key(parent, seq.cache_namespace, chunk)
            block_id = self.cached.get(key)
            if block_id is None:
                break
            block = self.blocks[block_id]
            if block.token_ids != chunk or block.namespace != seq.cache_namespace:
                self.stats.conflicts += record  # a key collision
                break
            if block.scope != seq.cache_scope:
                self.stats.conflicts += record  # KV computed under other weights
                if may_reuse is None or not may_reuse(block, seq):
                    break
            hits.append(block_id)
            parent = key
        return hits

    def can_allocate(
        self, seq: Sequence, max_new_tokens: int, may_reuse: ReuseCheck | None = None
    ) -> bool:
        """Whether ``seq`` (holding no blocks yet) can start, computing up to ``max_new_tokens``
        tokens past its cached prefix in this step."""
        return self.fits(*self.allocation(seq, max_new_tokens, may_reuse))

    def fits(self, needed: int, hits: list[int]) -> bool:
        """Whether ``needed`` new pages are free beside the cached blocks ``hits`` a request
        takes back (``allocation``'s answer)."""
        reclaimable = sum(1 for b in hits if self.blocks[b].ref_count == 0)
        return self.num_free_blocks - reclaimable >= needed

    def allocation(
        self, seq: Sequence, max_new_tokens: int, may_reuse: ReuseCheck | None = None
    ) -> tuple[int, list[int]]:
        """New pages ``seq`` (holding no blocks yet) takes to start, computing up to
        ``max_new_tokens`` tokens past its cached prefix, and the cached blocks it reuses."""
        hits = self._find_prefix(seq, may_reuse, record=False)
        cached = len(hits) * self.block_size
        copy_on_write = int(cached == len(seq.token_ids))
        cached -= copy_on_write
        num_new = min(len(seq.token_ids) - cached, max_new_tokens)
        return self.blocks_for(cached + num_new) - len(hits) + copy_on_write, hits

    def allocate(self, seq: Sequence, may_reuse: ReuseCheck | None = None) -> None:
        """Give ``seq`` its cached prefix blocks; it computes from the first uncached token.
        ``may_reuse`` decides on blocks computed under other weights (refused without it)."""
        assert not seq.block_table
        hits = self._find_prefix(seq, may_reuse, record=True)
        for block_id in hits:
            self.blocks[block_id].hits += 1
            self._take(block_id)
        seq.block_table = list(hits)
        cached = len(hits) * self.block_size
        self.stats.queried_tokens += len(seq.token_ids)
        if cached == len(seq.token_ids):
            # Every token is cached, but the last one must run again for its logits, which writes
            # its KV into the last block: copy that shared block first.
            cached -= 1
            src = seq.block_table[-1]
            dst = self._fresh_block()
            self.pending_copies.append((src, dst))
            self._release(src)
            seq.block_table[-1] = dst
            self.stats.copies_on_write += 1
        self.stats.hit_tokens += cached
        seq.num_computed_tokens = seq.num_cached_tokens = cached

    def can_append(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.num_free_blocks >= self.to_append(seq, num_new_tokens)

    def to_append(self, seq: Sequence, num_new_tokens: int) -> int:
        """New pages ``seq`` takes to hold ``num_new_tokens`` more tokens."""
        return max(
            self.blocks_for(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table), 0
        )

    def append(self, seq: Sequence, num_new_tokens: int) -> None:
        """Grow ``seq``'s block table to hold ``num_new_tokens`` more tokens."""
        needed = self.blocks_for(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        for _ in range(needed):
            seq.block_table.append(self._fresh_block())

    def commit(self, seq: Sequence) -> None:
        """Publish the blocks ``seq`` has filled completely, so later requests can reuse them."""
        if not self.enable_prefix_caching:
            return
        bs, full = self.block_size, seq.num_computed_tokens // self.block_size
        while len(seq.block_keys) < full:
            i = len(seq.block_keys)
            chunk = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            parent = seq.block_keys[-1] if seq.block_keys else None
            key = block_key(parent, seq.cache_namespace, chunk)
            seq.block_keys.append(key)
            block = self.blocks[seq.block_table[i]]
            if block.key is None and key not in self.cached:
                block.key, block.token_ids, block.namespace = key, chunk, seq.cache_namespace
                block.scope, block.depth = seq.cache_scope, i
                block.cached_at = block.last_used = self.clock()
                self.cached[key] = block.block_id

    def free(self, seq: Sequence) -> None:
        """Release ``seq``'s blocks, tail first, so a prefix stays cached longest."""
        for block_id in reversed(seq.block_table):
            self._release(block_id)
        seq.block_table = []
        seq.block_keys = []
        seq.num_computed_tokens = 0

    def _take(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self._idle[block_id]
        block.ref_count += 1
        block.last_used = self.clock()

    def _release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        assert block.ref_count >= 0, f"block {block_id} released twice"
        if block.ref_count:
            return
        if block.key is not None and self.cached.get(block.key) == block_id:
            block.last_used = self.clock()
            self._idle[block_id] = None
        else:
            self._forget(block_id)
            self._empty[block_id] = None

    def _fresh_block(self) -> int:
        block_id = self._fresh_page()
        self.blocks[block_id].ref_count = 1
        return block_id

    def _fresh_page(self) -> int:
        """A free page, blank: an empty one (while KV is within ``kv_pages``), else the least
        recently used cached block's."""
        if self._empty and (self.kv_pages is None or self.num_kv_pages < self.kv_pages):
            block_id, _ = self._empty.popitem(last=False)
        else:
            block_id, _ = self._idle.popitem(last=False)
        self._forget(block_id)
        return block_id
