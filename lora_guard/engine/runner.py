"""Runs a scheduled step on the model: the KV block copies it needs, the flat tensors of one
forward, the sampler. Owns the model and the cache pool whose pages hold the KV tensors."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lora_guard.engine.lora.checkpoint import LoRAAdapter
from lora_guard.engine.lora.compute import KernelPlans, LoraBatch, LoraSegment
from lora_guard.engine.lora.pool import CachePool, LayerWeights
from lora_guard.engine.model import AttentionBatch, LlamaModel
from lora_guard.engine.sampling import SamplerInput, sample
from lora_guard.engine.sequence import Sequence
from lora_guard.engine.step_plan import SchedulerOutput


@dataclass(slots=True)
class StepResult:
    """The next token of each sequence that reached the end of its known tokens in this step."""

    sampled: list[Sequence]
    tokens: list[int]
    logprobs: list[float]


class ModelRunner:
    def __init__(
        self,
        model: LlamaModel,
        pool: CachePool,
        lora_mode: str = "loop",
        *,
        merge_for_good: bool = False,
    ) -> None:
        self.model, self.pool, self.kv_cache = model, pool, pool.kv
        self.block_size, self.lora_mode = pool.block_size, lora_mode
        self.merge_for_good = merge_for_good  # the static baseline: no unmerge, no copy kept
        self.device = model.device
        self.plans = KernelPlans()  # the kernel's plan of each adapter's weights in the pool
        self.eos_token_ids: frozenset[int] = frozenset()  # the engine's, for ``min_tokens``

    def merge(self, adapter: LoRAAdapter | None) -> None:
        """Merged mode: fold ``adapter`` into the base weights (None: the base model again)."""
        if adapter is None:
            self.model.unmerge_lora()
        else:
            self.model.merge_lora(adapter.weights, reversible=not self.merge_for_good)

    def run(self, plan: SchedulerOutput) -> StepResult:
        for src, dst in plan.copies:
            self.kv_cache.copy_block(src, dst, self.block_size)
        logits, sampled = self._forward(plan)
        rows = [SamplerInput(s.params, s.generator, s.token_ids, self._banned(s)) for s in sampled]
        tokens, logprobs = sample(logits, rows)
        return StepResult(sampled, tokens, logprobs)

    def _banned(self, seq: Sequence) -> tuple[int, ...]:
        """The end tokens ``seq`` may not generate yet (``min_tokens``)."""
        params = seq.params
        if len(seq.output_token_ids) >= params.min_tokens:
            return ()
        return tuple(sorted(self.eos_token_ids | set(params.stop_token_ids)))

    def _plan_of(self, layers: list[LayerWeights]) -> torch.Tensor | None:
        return self.plans.of(layers) if self.lora_mode == "kernel" else None

    def _forward(self, plan: SchedulerOutput) -> tuple[torch.Tensor, list[Sequence]]:
        # Sequences under one adapter sit next to each other, so each adapter's tokens are one
        # segment of the flat batch. Base-model sequences (no adapter) go first.
        ordered = sorted(
            plan.scheduled, key=lambda s: -1 if s.adapter is None else s.adapter.first_page
        )
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
                    where = self._plan_of(item.adapter.layers)
                    segments.append(LoraSegment(start, start + n, item.adapter.layers, where))
            if ctx == len(seq.token_ids):
                logits_rows.append(start + n - 1)
                sampled.append(seq)
        attn = AttentionBatch(
            slot_mapping=torch.tensor(slot_mapping, device=self.device),
            prefills=prefills,
            decode_rows=None,
            decode_slots=None,
            decode_lengths=None,
        )
        if decodes:
            self._batch_decodes(attn, decodes)
        logits = self.model.forward(
            torch.tensor(input_ids, device=self.device),
            torch.tensor(positions, device=self.device),
            attn,
            (self.kv_cache.k, self.kv_cache.v),
            LoraBatch(segments, self.lora_mode, self.pool.lora_arena) if segments else None,
            torch.tensor(logits_rows, device=self.device, dtype=torch.long),
        )
        return logits, sampled

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
        pos = torch.arange(max_ctx, device=self.device)
        attn.decode_rows = torch.tensor([row for row, _, _ in decodes], device=self.device)
        attn.decode_slots = tables[:, pos // bs] * bs + pos % bs
        attn.decode_lengths = lengths
