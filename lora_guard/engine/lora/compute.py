"""The LoRA update of one step: ``y += (x @ A.T) @ B`` for every token under its own adapter.

The runner groups a step's tokens by adapter, so each adapter's tokens are one contiguous segment
of the flat batch. Two ways compute the same thing:

- ``loop``: per segment, one shrink over the fused projection's stacked ``A`` and one expand per
  sub-module, straight from the adapter's pages (no copy).
- ``kernel``: per projection, one call of the compiled kernel (``sgmv.cpp``) that runs the same
  shrink and expands for every segment straight from the pool's pages: the loop's BLAS calls
  without a Python dispatch each. It sums in float32 from float32 or bfloat16 pages (widened
  exactly as it reads them), for a float32 or a bfloat16 model (whose activations it widens once
  and whose outputs it rounds once); ``auto`` (the default) takes it where it builds and loads,
  else ``loop``.
- ``batched``: per projection, one shrink and one expand over all segments at once (torch's
  batched matmul over segments padded to the longest and ranks padded to the largest), gathering
  the adapters' matrices into one stack first: SGMV done with torch operations, slower on the CPU
  (the gather costs more than it saves).

All are checked against each other in the tests.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from lora_guard.engine import native
from lora_guard.engine.lora import kernel
from lora_guard.engine.lora.pool import LayerWeights
from lora_guard.engine.spec import FUSED_PROJECTIONS

MODES = ("auto", "kernel", "loop", "batched")
PROJECTIONS = tuple(FUSED_PROJECTIONS)
_INDEX = {projection: i for i, projection in enumerate(PROJECTIONS)}
MAX_PARTS = max(len(modules) for modules in FUSED_PROJECTIONS.values())
_PLAN_WIDTH = 2 + 5 * MAX_PARTS  # a_offset, rows, then row0, row1, out0, out1, bt_offset a part


@dataclass(slots=True)
class LoraSegment:
    """Tokens ``start:end`` of the flat batch run under the adapter whose weights are ``layers``."""

    start: int
    end: int
    layers: list[LayerWeights]
    plan: torch.Tensor | None = None  # ``kernel_plan(layers)``, for the kernel


def kernel_plan(layers: list[LayerWeights]) -> torch.Tensor:
    """Where an adapter's matrices sit in the storage its views share, as the kernel reads them:
    int64 [layers, projections, 2 + 5 * parts] of element offsets and shapes (rows 0: the adapter
    has no weights for that projection)."""
    plan = torch.zeros(len(layers), len(PROJECTIONS), _PLAN_WIDTH, dtype=torch.long)
    for layer, weights in enumerate(layers):
        for index, projection in enumerate(PROJECTIONS):
            w = weights.get(projection)
            if w is None:
                continue
            row = [w.a.storage_offset(), w.a.shape[0]]
            for part in w.parts:
                row += [part.row0, part.row1, part.out0, part.out1, part.bt.storage_offset()]
            plan[layer, index, : len(row)] = torch.tensor(row)
    return plan


class KernelPlans:
    """Each adapter's :func:`kernel_plan`, made once per place its weights take in the pool (an
    adapter that moves has new ``layers``, so a new plan); the least recently used leave past
    ``most``."""

    def __init__(self, most: int = 256) -> None:
        self.most = most
        self._made: OrderedDict[int, tuple[list[LayerWeights], torch.Tensor]] = OrderedDict()

    def of(self, layers: list[LayerWeights]) -> torch.Tensor:
        key = id(layers)
        made = self._made.get(key)
        if made is None or made[0] is not layers:
            made = self._made[key] = (layers, kernel_plan(layers))
        self._made.move_to_end(key)
        if len(self._made) > self.most:
            self._made.popitem(last=False)
        return made[1]


KERNEL_WEIGHTS = (torch.float32, torch.bfloat16)
KERNEL_ACTIVATIONS = (torch.float32, torch.bfloat16)


def resolve_mode(
    mode: str, dtype: torch.dtype, device: torch.device, lora_dtype: torch.dtype | None = None
) -> str:
    """The computation a step uses: ``auto`` is ``kernel`` where the kernel applies and loads,
    else ``loop``; an explicit ``kernel`` that cannot run is an error."""
    weights = lora_dtype or dtype
    applies = dtype in KERNEL_ACTIVATIONS and device.type == "cpu" and weights in KERNEL_WEIGHTS
    if mode == "kernel":
        if not applies:
            raise ValueError(
                "lora_compute=kernel runs on the CPU, for a float32 or bfloat16 model with "
                "float32 or bfloat16 adapter weights"
            )
        if not native.load():
            raise ValueError(f"lora_compute=kernel: the kernel cannot be built: {native.error()}")
    if mode == "auto":
        return "kernel" if applies and native.load() else "loop"
    return mode


class LoraBatch:
    """A step's adapter segments; the model calls :meth:`apply` after each base projection."""

    def __init__(
        self, segments: list[LoraSegment], mode: str = "loop", pool: torch.Tensor | None = None
    ) -> None:
        if mode not in MODES[1:]:
            raise ValueError(f"lora compute mode must be one of {', '.join(MODES[1:])}")
        self.segments, self.mode = segments, mode
        if mode == "kernel":
            if pool is None:
                raise ValueError("the kernel reads the adapters' matrices from the pool")
            self._arena: torch.Tensor = pool
            self._plan = _step_plan(segments)
            # One view per layer and projection, made once a step: a call indexes a list.
            self._plans = [list(layer.unbind(0)) for layer in self._plan.unbind(0)]
        # The flat batch cut once per projection into runs (one ``split``, not a slice per
        # segment): the segments' runs, and the tokens of no adapter between them.
        self._runs: list[int] = []
        self._run_of: list[int] = []
        self._end = 0
        for seg in segments:
            if seg.start > self._end:
                self._runs.append(seg.start - self._end)
            self._run_of.append(len(self._runs))
            self._runs.append(seg.end - seg.start)
            self._end = seg.end

    def apply(self, x: torch.Tensor, y: torch.Tensor, layer: int, projection: str) -> None:
        """Add the LoRA update of ``projection`` in ``layer`` to ``y`` in place."""
        if self.mode == "kernel":
            kernel.lora_apply(x, y, self._arena, self._plans[layer][_INDEX[projection]])
            return
        if self.mode == "batched":
            work = [(s, w) for s in self.segments if (w := s.layers[layer].get(projection))]
            if len(work) > 1:
                _batched(x, y, work)
                return
        xs, ys = torch.split(x[: self._end], self._runs), torch.split(y[: self._end], self._runs)
        dtype = x.dtype  # weights of another dtype (lora_dtype) are converted to it per call
        for run, seg in zip(self._run_of, self.segments, strict=True):
            weights = seg.layers[layer].get(projection)
            if weights is None:
                continue
            shrunk, out = torch.mm(xs[run], weights.at.to(dtype)), ys[run]
            for part in weights.parts:
                bt = part.bt.to(dtype)
                out[:, part.out0 : part.out1].addmm_(shrunk[:, part.row0 : part.row1], bt)


def _step_plan(segments: list[LoraSegment]) -> torch.Tensor:
    """The kernel's plan of a step: int64 [layers, projections, segments, 4 + 5 * parts], each
    segment's start and end before its adapter's plan."""
    plans = [seg.plan for seg in segments]
    if any(plan is None for plan in plans):
        raise ValueError("the kernel needs each segment's plan (KernelPlans.of)")
    adapters = torch.stack(plans, dim=2)  # type: ignore[arg-type]  # [layers, projections, segments, plan]
    bounds = torch.tensor([[seg.start, seg.end] for seg in segments], dtype=torch.long)
    layers, projections = adapters.shape[:2]
    bounds = bounds.expand(layers, projections, len(segments), 2)
    return torch.cat((bounds, adapters), dim=3).contiguous()


def _batched(x: torch.Tensor, y: torch.Tensor, work: list) -> None:  # type: ignore[type-arg]
    """All segments of one projection in one shrink and one expand per sub-module slot."""
    n = len(work)
    longest = max(seg.end - seg.start for seg, _ in work)
    rows = max(w.a.shape[0] for _, w in work)
    fan_in = x.shape[1]
    xs = x.new_zeros(n, longest, fan_in)
    a = x.new_zeros(n, rows, fan_in)
    for i, (seg, w) in enumerate(work):
        xs[i, : seg.end - seg.start] = x[seg.start : seg.end]
        a[i, : w.a.shape[0]] = w.a
    shrunk = torch.bmm(xs, a.transpose(1, 2))  # [n, longest, rows]
    width = y.shape[1]
    b = x.new_zeros(n, rows, width)
    for i, (_, w) in enumerate(work):
        for part in w.parts:
            b[i, part.row0 : part.row1, part.out0 : part.out1] = part.bt
    update = torch.bmm(shrunk, b)  # [n, longest, out]
    for i, (seg, _) in enumerate(work):
        y[seg.start : seg.end] += update[i, : seg.end - seg.start]
