"""The LoRA update of one step: ``y += (x @ A.T) @ B`` for every token under its own adapter.

The runner groups a step's tokens by adapter, so each adapter's tokens are one contiguous segment
of the flat batch. Two ways compute the same thing:

- ``loop``: per segment, one shrink over the fused projection's stacked ``A`` and one expand per
  sub-module, straight from the adapter's pages (no copy).
- ``batched``: per projection, one shrink and one expand over all segments at once (torch's
  batched matmul over segments padded to the longest and ranks padded to the largest), gathering
  the adapters' matrices into one stack first: SGMV done with torch operations.

``loop`` is the default on CPU, where the gather costs as much as it saves (see
docs/engine.md); the two are checked against each other in the tests.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lora_guard.engine.lora.pool import LayerWeights

MODES = ("loop", "batched")


@dataclass(slots=True)
class LoraSegment:
    """Tokens ``start:end`` of the flat batch run under the adapter whose weights are ``layers``."""

    start: int
    end: int
    layers: list[LayerWeights]


class LoraBatch:
    """A step's adapter segments; the model calls :meth:`apply` after each base projection."""

    def __init__(self, segments: list[LoraSegment], mode: str = "loop") -> None:
        if mode not in MODES:
            raise ValueError(f"lora compute mode must be one of {', '.join(MODES)}")
        self.segments, self.mode = segments, mode
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
        if self.mode == "batched":
            work = [(s, w) for s in self.segments if (w := s.layers[layer].get(projection))]
            if len(work) > 1:
                _batched(x, y, work)
                return
        xs, ys = torch.split(x[: self._end], self._runs), torch.split(y[: self._end], self._runs)
        for run, seg in zip(self._run_of, self.segments, strict=True):
            weights = seg.layers[layer].get(projection)
            if weights is None:
                continue
            shrunk, out = torch.mm(xs[run], weights.at), ys[run]
            for part in weights.parts:
                out[:, part.out0 : part.out1].addmm_(shrunk[:, part.row0 : part.row1], part.bt)


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
