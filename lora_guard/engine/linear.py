"""A base-model projection, its weight kept in the layout the device multiplies fastest.

On a CPU whose torch has oneDNN, a float32 or bfloat16 weight is reordered once, at load, into
oneDNN's blocked layout (the one torch's own compiler uses for frozen CPU graphs), and multiplied
with ``mkldnn._linear_pointwise``: in float32 a decode step of the demo model at 32 rows spends
about half the time in its matmuls that ``torch.mm`` over the plain weights did; in bfloat16 a
one-stream step gains most (docs/benchmarks.md). Elsewhere (float16, GPUs) the weight stays a
plain ``[in, out]`` tensor multiplied with ``torch.mm``. The blocked weight
replaces the plain one: a merge (``dense`` / ``replace``) unpacks and packs again.
"""

from __future__ import annotations

import torch

# Rows the blocked layout is tuned for; any number of rows multiplies correctly.
_TUNED_ROWS = 32


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

    __slots__ = ("_weight", "bias", "blocked")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, *, blocked: bool) -> None:
        self.blocked = blocked
        self.bias = bias
        self._weight = self._store(weight)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
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
        if self.blocked:
            return self._weight.to_dense()
        return self._weight.t().contiguous()

    def replace(self, weight: torch.Tensor) -> None:
        """Use ``weight`` (``[out, in]``) from now on."""
        self._weight = self._store(weight)

    @property
    def nbytes(self) -> int:
        tensors = [self._weight] if self.bias is None else [self._weight, self.bias]
        return sum(t.numel() * t.element_size() for t in tensors)

    def _store(self, weight: torch.Tensor) -> torch.Tensor:
        if self.blocked:
            packed: torch.Tensor = torch.ops.mkldnn._reorder_linear_weight(
                weight.contiguous(), _TUNED_ROWS
            )
            return packed
        # [in, out]: ``x @ w`` over this layout runs about a third faster than ``F.linear`` at 32
        # decode rows on the CPU.
        return weight.t().contiguous()
