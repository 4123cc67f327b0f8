"""Greedy decoding through transformers' ``generate`` on a left-padded batch: the demo's teacher,
and the bench's transformers + PEFT runs."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def left_pad(
    rows: Sequence[Sequence[int]], pad: int, device: torch.device | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The token ids of ``rows`` padded on the left to one width, and their attention mask."""
    width = max(len(r) for r in rows)
    ids = torch.tensor([[pad] * (width - len(r)) + list(r) for r in rows], device=device)
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=device)
    return ids, mask


def greedy(
    model: Any, ids: torch.Tensor, mask: torch.Tensor, new_tokens: int, pad: int, **options: Any
) -> Any:
    """``model.generate``'s greedy rows (prompt and new tokens) for a batch from ``left_pad``;
    ``options`` go to ``generate`` as well."""
    with torch.no_grad():
        return model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=pad,
            **options,
        )
