"""The compiled LoRA kernel's call (``sgmv.cpp``, built with the engine's other compiled
operations by ``engine/native``: call ``native.load()`` first)."""

from __future__ import annotations

import torch

_op: list[object] = []


def lora_apply(x: torch.Tensor, y: torch.Tensor, pool: torch.Tensor, plan: torch.Tensor) -> None:
    """``y += `` the LoRA update of every segment in ``plan`` (see ``sgmv.cpp``)."""
    if not _op:
        _op.append(torch.ops.lora_guard.lora_apply.default)
    _op[0](x, y, pool, plan)  # type: ignore[operator]
