"""One memory pool, allocated once, for KV blocks and adapter weights (S-LoRA's unified paging).

The pool is ``arena[layers, 2, pages, page_elems]`` with ``page_elems = block_size * kv_heads *
head_dim``. Page ``p`` is KV block ``p``: its keys in ``arena[:, 0, p]``, its values in
``arena[:, 1, p]``, so the KV tensors are plain views of the arena. An adapter takes a run of
consecutive pages ``[first, first + n)``; in each layer, its run's key half holds the ``A``
matrices and its value half the ``B`` matrices (transposed), each of exactly the module's rank:

    layer l, fused projection qkv:  A = [A_q; A_k; A_v]   [r_q + r_k + r_v, hidden]   (key half)
                                    B_q.T [r_q, q_out], B_k.T [r_k, kv_out], ...     (value half)

Nothing is padded to a maximum rank and no zero block is stored. Adapters sit at the bottom of
the pool, packed without holes (an eviction moves the ones above down); KV blocks use the pages
above them. Memory never exceeds the pool: a load that does not fit waits. Adapter pages may hold
another dtype than the KV (``lora_dtype``): an adapter's run is then viewed as that dtype, so a
bfloat16 adapter beside float32 KV takes half the pages.
"""

from __future__ import annotations

import mmap
from collections.abc import Iterable
from dataclasses import dataclass, field
from math import prod

import torch

from lora_guard.engine.kv_cache import KVCache
from lora_guard.engine.lora.checkpoint import LoRAAdapter
from lora_guard.engine.spec import FUSED_PROJECTIONS, ModelSpec


@dataclass(frozen=True, slots=True)
class ModulePart:
    """One sub-module of a fused projection: rows ``rows`` of the shrunk activations expand
    through ``bt`` [rank, out] into output columns ``out0:out1``."""

    row0: int
    row1: int
    out0: int
    out1: int
    bt: torch.Tensor


@dataclass(frozen=True, slots=True)
class ProjectionWeights:
    """An adapter's weights for one fused projection of one layer."""

    a: torch.Tensor  # [sum of the sub-modules' ranks, in]
    parts: tuple[ModulePart, ...]
    at: torch.Tensor = field(init=False)  # ``a.t()``, made once: the shrink is ``x @ at``

    def __post_init__(self) -> None:
        object.__setattr__(self, "at", self.a.t())


LayerWeights = dict[str, ProjectionWeights]  # fused projection -> weights


@dataclass(frozen=True, slots=True)
class _Placement:
    """Where one (layer, module) matrix pair sits inside an adapter's run."""

    layer: int
    module: str
    projection: str
    rank: int
    row0: int  # first row in the projection's stacked A
    a_offset: int  # elements into the run's key half of this layer
    b_offset: int  # elements into the run's value half


@dataclass(frozen=True, slots=True)
class AdapterLayout:
    """How an adapter's matrices pack into pages; computed once per adapter."""

    num_pages: int
    placements: tuple[_Placement, ...]
    nbytes: int  # bytes of its weights (without the rounding up to pages)
    rank: int  # the largest rank over its modules


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero tensor. On a CPU its memory is an anonymous map, zero by definition and committed
    page by page as it is first written: the pool's resident memory is what the cache has used,
    not its size."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS  # a forked child gets its own copy
    memory = mmap.mmap(-1, max(prod(shape) * dtype.itemsize, 1), flags=flags)
    return torch.frombuffer(memory, dtype=dtype).view(shape)


class CachePool:
    def __init__(
        self,
        spec: ModelSpec,
        num_pages: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        lora_dtype: torch.dtype | None = None,
    ) -> None:
        self.spec, self.num_pages, self.block_size = spec, num_pages, block_size
        self.page_elems = block_size * spec.num_kv_heads * spec.head_dim
        self.lora_dtype = lora_dtype or dtype
        # adapter elements a page holds
        self.lora_page_elems = self.lora_elements(spec, block_size, dtype, self.lora_dtype)
        self.arena = zeroed((spec.num_layers, 2, num_pages, self.page_elems), dtype, device)
        # The whole arena as the adapters' dtype: what the kernel reads, offsets in its elements.
        self.lora_arena = self.arena.view(-1).view(self.lora_dtype)
        shape = (spec.num_layers, num_pages * block_size, spec.num_kv_heads, spec.head_dim)
        self.kv = KVCache(self.arena[:, 0].view(shape), self.arena[:, 1].view(shape))

    @staticmethod
    def lora_elements(
        spec: ModelSpec, block_size: int, dtype: torch.dtype, lora_dtype: torch.dtype
    ) -> int:
        """Adapter elements (of ``lora_dtype``) one page of each layer's key or value half holds."""
        ratio = dtype.itemsize / lora_dtype.itemsize
        page_elems = block_size * spec.num_kv_heads * spec.head_dim
        if ratio * page_elems != int(ratio * page_elems):
            raise ValueError(f"a page of {dtype} cannot hold {lora_dtype} adapter weights")
        return int(ratio * page_elems)

    @staticmethod
    def pages_for(per_layer: Iterable[tuple[int, int]], lora_page_elems: int) -> int:
        """Pages an adapter takes, from its A and B elements in each layer: its run holds every
        layer's A in the key half and B in the value half, so the fullest half decides."""
        most = max((max(a, b) for a, b in per_layer), default=0)
        return max(1, -(-most // lora_page_elems))

    @staticmethod
    def page_bytes(spec: ModelSpec, block_size: int, dtype: torch.dtype) -> int:
        return KVCache.bytes_per_block(
            spec.num_layers, block_size, spec.num_kv_heads, spec.head_dim, dtype
        )

    def nbytes(self) -> int:
        return self.arena.numel() * self.arena.element_size()

    # adapters
    def layout(self, adapter: LoRAAdapter) -> AdapterLayout:
        placements = []
        a_used = [0] * self.spec.num_layers
        b_used = [0] * self.spec.num_layers
        elems = 0
        for layer in range(self.spec.num_layers):
            for projection, modules in FUSED_PROJECTIONS.items():
                row0 = 0
                for module in modules:
                    pair = adapter.weights.get((layer, module))
                    if pair is None:
                        continue
                    a, b = pair
                    rank = a.shape[0]
                    placements.append(
                        _Placement(
                            layer, module, projection, rank, row0, a_used[layer], b_used[layer]
                        )
                    )
                    row0 += rank
                    a_used[layer] += a.numel()
                    b_used[layer] += b.numel()
                    elems += a.numel() + b.numel()
        num_pages = self.pages_for(zip(a_used, b_used, strict=True), self.lora_page_elems)
        rank = max((p.rank for p in placements), default=0)
        return AdapterLayout(num_pages, tuple(placements), elems * self.lora_dtype.itemsize, rank)

    def write(self, adapter: LoRAAdapter, layout: AdapterLayout, first_page: int) -> None:
        """Copy ``adapter``'s weights into pages ``first_page ...``, as the pages' ``lora_dtype``
        (the loader has read them in it already)."""
        halves = self._halves(first_page, layout.num_pages)
        for place in layout.placements:
            a, b = adapter.weights[place.layer, place.module]
            key_half, value_half = halves[place.layer]
            key_half[place.a_offset : place.a_offset + a.numel()].view_as(a).copy_(a)
            bt = value_half[place.b_offset : place.b_offset + b.numel()].view(b.shape[1], -1)
            bt.copy_(b.T)

    def views(self, layout: AdapterLayout, first_page: int) -> list[LayerWeights]:
        """Per layer, the adapter's weights as views into its pages (no copy)."""
        halves = self._halves(first_page, layout.num_pages)
        by_projection: dict[tuple[int, str], list[_Placement]] = {}
        for place in layout.placements:
            by_projection.setdefault((place.layer, place.projection), []).append(place)
        layers: list[LayerWeights] = [{} for _ in range(self.spec.num_layers)]
        for (layer, projection), places in by_projection.items():
            key_half, value_half = halves[layer]
            fan_in = self.spec.module_shape(places[0].module)[0]
            rows = sum(p.rank for p in places)
            start = places[0].a_offset
            a = key_half[start : start + rows * fan_in].view(rows, fan_in)
            parts = []
            for p in places:
                _, out0, out1 = self.spec.fused_rows(p.module)
                bt = value_half[p.b_offset : p.b_offset + p.rank * (out1 - out0)].view(p.rank, -1)
                parts.append(ModulePart(p.row0, p.row0 + p.rank, out0, out1, bt))
            layers[layer][projection] = ProjectionWeights(a, tuple(parts))
        return layers

    def move_pages(self, src: int, dst: int, count: int) -> None:
        """Move pages ``[src, src + count)`` to ``[dst, dst + count)``, ``dst < src``; the ranges
        may overlap (copied front to back in chunks that do not)."""
        assert dst < src
        step = src - dst
        for offset in range(0, count, step):
            n = min(step, count - offset)
            self.arena[:, :, dst + offset : dst + offset + n] = self.arena[
                :, :, src + offset : src + offset + n
            ]

    def copy_page(self, src: int, dst: int) -> None:
        self.arena[:, :, dst] = self.arena[:, :, src]

    def _halves(self, first_page: int, num_pages: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        run = slice(first_page, first_page + num_pages)
        dtype = self.lora_dtype
        return [
            (
                self.arena[layer, 0, run].view(-1).view(dtype),
                self.arena[layer, 1, run].view(-1).view(dtype),
            )
            for layer in range(self.spec.num_layers)
        ]
