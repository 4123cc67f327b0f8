"""Turns a scheduled step into the flat tensors one model forward needs, and runs it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lora_guard.engine.kv_cache import KVCache
from lora_guard.engine.lora.compute import LoraBatch, LoraSegment
from lora_guard.engine.model import AttentionBatch, LlamaModel
from lora_guard.engine.scheduler import ScheduledSeq
from lora_guard.engine.sequence import Sequence


@dataclass(slots=True)
class StepResult:
    """Logits for the sequences that reached the end of their known tokens in this step."""

    sampled: list[Sequence]
    logits: torch.Tensor


class ModelRunner:
    def __init__(
        self, model: LlamaModel, kv_cache: KVCache, block_size: int, lora_mode: str = "loop"
    ) -> None:
        self.model, self.kv_cache, self.block_size = model, kv_cache, block_size
        self.lora_mode = lora_mode
        self.device = model.device

    def run(self, scheduled: list[ScheduledSeq]) -> StepResult:
        # Sequences under one adapter sit next to each other, so each adapter's tokens are one
        # segment of the flat batch. Base-model sequences (no adapter) go first.
        ordered = sorted(scheduled, key=lambda s: -1 if s.adapter is None else s.adapter.first_page)
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        prefills: list[tuple[int, int, int, torch.Tensor]] = []
        decodes: list[tuple[int, Sequence, int]] = []
        segments: list[LoraSegment] = []
        logits_rows: list[int] = []
        sampled: list[Sequence] = []
        for item in ordered:
            seq, n = item.seq, item.num_new_tokens
            start, first = len(input_ids), seq.num_computed_tokens
            ctx = first + n
            input_ids.extend(seq.token_ids[first:ctx])
            positions.extend(range(first, ctx))
            table = seq.block_table
            slot_mapping.extend(table[p // bs] * bs + p % bs for p in range(first, ctx))
            if n == 1 and first > 0:
                decodes.append((start, seq, ctx))
            else:
                prefills.append((start, n, ctx, self._context_slots(table, ctx)))
            if item.adapter is not None:
                if segments and segments[-1].layers is item.adapter.layers:
                    segments[-1].end = start + n
                else:
                    segments.append(LoraSegment(start, start + n, item.adapter.layers))
            if ctx == len(seq.token_ids):
                logits_rows.append(start + n - 1)
                sampled.append(seq)
        attn = AttentionBatch(
            slot_mapping=torch.tensor(slot_mapping, device=self.device),
            prefills=prefills,
            decode_rows=None,
            decode_slots=None,
            decode_mask=None,
        )
        if decodes:
            self._batch_decodes(attn, decodes)
        logits = self.model.forward(
            torch.tensor(input_ids, device=self.device),
            torch.tensor(positions, device=self.device),
            attn,
            (self.kv_cache.k, self.kv_cache.v),
            LoraBatch(segments, self.lora_mode) if segments else None,
            torch.tensor(logits_rows, device=self.device, dtype=torch.long),
        )
        return StepResult(sampled, logits)

    def _context_slots(self, table: list[int], ctx: int) -> torch.Tensor:
        blocks = torch.tensor(table[: -(-ctx // self.block_size)], device=self.device)
        offsets = torch.arange(self.block_size, device=self.device)
        return (blocks[:, None] * self.block_size + offsets[None, :]).flatten()[:ctx]

    def _batch_decodes(
        self, attn: AttentionBatch, decodes: list[tuple[int, Sequence, int]]
    ) -> None:
        bs = self.block_size
        max_ctx = max(ctx for _, _, ctx in decodes)
        max_blocks = -(-max_ctx // bs)
        tables = torch.zeros(len(decodes), max_blocks, dtype=torch.long)
        lengths = torch.empty(len(decodes), dtype=torch.long)
        for i, (_, seq, ctx) in enumerate(decodes):
            used = seq.block_table[: -(-ctx // bs)]
            tables[i, : len(used)] = torch.tensor(used)
            lengths[i] = ctx
        tables, lengths = tables.to(self.device), lengths.to(self.device)
        pos = torch.arange(max_blocks * bs, device=self.device)
        slots = tables[:, pos // bs] * bs + pos % bs
        attn.decode_rows = torch.tensor([row for row, _, _ in decodes], device=self.device)
        attn.decode_slots = slots[:, :max_ctx]
        attn.decode_mask = pos[None, :max_ctx] < lengths[:, None]
