"""A base-model projection, its weight kept in the layout the device multiplies fastest.

On a CPU whose torch has oneDNN, a float32 or bfloat16 weight is reordered once, at load, into
oneDNN's blocked layout (the one torch's own compiler uses for frozen CPU graphs), and multiplied
with ``mkldnn._linear_pointwise``: in float32 a decode step of the demo model at 32 rows spends
about half the time in its matmuls that ``torch.mm`` over the plain weights did; in bfloat16 a
one-stream step gains most (docs/benchmarks.md). Elsewhere (float16, GPUs) the weight stays a
plain ``[in, out]`` tensor multiplied with ``torch.mm``. The blocked weight
replaces the plain one: a merge (``dense`` / ``replace``) unpacks and packs again.

With ``rows``, a projection also keeps its weight's rows ``[out, in]`` for a decode step's few
rows: the compiled ``row_linear`` (``row_linear.cpp``) streams them from memory once for all
the step's sequences, faster than oneDNN's blocked kernel up to :data:`ROW_KERNEL_ROWS` rows
(one stream of the demo model in bfloat16: 0.73x the step time, docs/benchmarks.md); larger
batches and prefills take the other layout. That is a second copy of the weights; a tied head's
rows are the embedding table itself.
"""

from __future__ import annotations

import torch

# Rows the blocked layout is tuned for; any number of rows multiplies correctly.
_TUNED_ROWS = 32
# Most rows of x for which the row kernel beats oneDNN's blocked one, by the weight's dtype
# (scripts/row_linear_timings.py: the demo's projections, two threads).
ROW_KERNEL_ROWS = {torch.bfloat16: 3, torch.float32: 8}


def blocked_layout_available(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether weights of ``dtype`` on ``device`` can be kept in oneDNN's blocked layout."""
    return (
        device.type == "cpu"
        and dtype in (torch.float32, torch.bfloat16)
        and torch.backends.mkldnn.is_available()  # type: ignore[no-untyped-call]
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


class Linear:
    """``y = x @ weight.T + bias`` for a weight given ``[out, in]``."""

    __slots__ = ("_rows", "_weight", "bias", "blocked", "row_limit")

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None, *, blocked: bool, rows: bool = False
    ) -> None:
        """``rows``: also keep ``weight``'s rows for the row kernel (the compiled library must
        be loaded, ``engine/native``)."""
        self.blocked = blocked
        self.bias = bias
        self.row_limit = ROW_KERNEL_ROWS.get(weight.dtype, 0) if rows else 0
        self._rows = weight.contiguous() if self.row_limit else None
        self._weight = self._store(weight)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._rows is not None and 0 < x.shape[0] <= self.row_limit:
            rows: torch.Tensor = torch.ops.lora_guard.row_linear(
                x.contiguous(), self._rows, self.bias
            )
            return rows
        if self.blocked:
            y: torch.Tensor = torch.ops.mkldnn._linear_pointwise(
                x, self._weight, self.bias, "none", [], ""
            )
            return y
        if self.bias is None:
            return torch.mm(x, self._weight)
        return torch.addmm(self.bias, x, self._weight)

    def dense(self) -> torch.Tensor:
        """A plain ``[out, in]`` copy of the weight."""
        if self._rows is not None:
            return self._rows.clone()
        if self.blocked:
            return self._weight.to_dense()
        return self._weight.t().contiguous()

    def replace(self, weight: torch.Tensor) -> None:
        """Use ``weight`` (``[out, in]``) from now on."""
        if self._rows is not None:
            self._rows = weight.contiguous()
        self._weight = self._store(weight)

    def tensors(self) -> list[torch.Tensor]:
        """What this projection holds: its weight in each layout kept, and its bias."""
        held = [self._weight] if self._rows is None else [self._weight, self._rows]
        return held if self.bias is None else [*held, self.bias]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    @property
    def read_bytes(self) -> int:
        """Bytes one multiplication reads: the weight in one layout, and the bias."""
        bias = 0 if self.bias is None else self.bias.numel() * self.bias.element_size()
        return self._weight.numel() * self._weight.element_size() + bias

    def _store(self, weight: torch.Tensor) -> torch.Tensor:
        if self.blocked:
            packed: torch.Tensor = torch.ops.mkldnn._reorder_linear_weight(
                weight.contiguous(), _TUNED_ROWS
            )
            return packed
        # [in, out]: ``x @ w`` over this layout runs about a third faster than ``F.linear`` at 32
        # decode rows on the CPU.
        return weight.t().contiguous()
