"""Continuous batching: which sequences run in the next step, and how many tokens each.

Every step, running sequences come first (one token for a decode, the next chunk for a prompt
still being read), then waiting ones are admitted while the token budget, the sequence cap, the
KV pool and their adapter allow. When blocks run out, the most recently admitted running sequence
is preempted: its blocks are freed and it is recomputed later.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from lora_guard.engine.adapter_manager import AdapterManager
from lora_guard.engine.kv_cache import BlockManager
from lora_guard.engine.lora import AdapterError
from lora_guard.engine.sequence import Sequence, Status

# Sets a sequence's prefix-cache namespace and scope once its adapter's weights are known.
CacheBinder = Callable[[Sequence, str | None], None]


@dataclass(slots=True)
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    failed: list[tuple[Sequence, str]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class Scheduler:
    def __init__(
        self,
        blocks: BlockManager,
        adapters: AdapterManager,
        bind_cache: CacheBinder,
        max_batch_tokens: int,
        max_num_seqs: int,
    ) -> None:
        self.blocks, self.adapters, self.bind_cache = blocks, adapters, bind_cache
        self.max_batch_tokens, self.max_num_seqs = max_batch_tokens, max_num_seqs
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def order_waiting(self) -> list[Sequence]:
        """The order in which waiting sequences are offered a place (batch-form decisions)."""
        return list(self.waiting)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        for adapter_id, error in self.adapters.poll().items():
            for seq in [s for s in self.waiting if s.adapter_id == adapter_id]:
                self.waiting.remove(seq)
                out.failed.append((seq, str(error)))
        budget = self._schedule_running(out, self.max_batch_tokens)
        self._schedule_waiting(out, budget)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_uncomputed_tokens, budget)
            while not self.blocks.can_append(seq, n):
                victim = self.running[-1]
                self.preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            else:
                self.blocks.append(seq, n)
                out.scheduled.append(ScheduledSeq(seq, n))
                budget -= n
                i += 1
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        for seq in self.order_waiting():
            if budget <= 0 or len(self.running) >= self.max_num_seqs:
                break
            content_hash = None
            if seq.adapter_id is not None:
                try:
                    binding = self.adapters.acquire(seq.adapter_id)
                except AdapterError as exc:
                    self.waiting.remove(seq)
                    out.failed.append((seq, str(exc)))
                    continue
                if binding is None:
                    continue  # its adapter is loading; the others go on
                seq.lora_slot, content_hash = binding.slot, binding.content_hash
            self.bind_cache(seq, content_hash)
            if not self.blocks.can_allocate(seq, budget):
                self._unbind(seq)
                break
            self.blocks.allocate(seq)
            n = min(seq.num_uncomputed_tokens, budget)
            self.blocks.append(seq, n)
            self.waiting.remove(seq)
            seq.status = Status.RUNNING
            self.running.append(seq)
            out.scheduled.append(ScheduledSeq(seq, n))
            budget -= n

    def preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.free(seq)
        self._unbind(seq)
        seq.status = Status.WAITING
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence) -> None:
        """Take ``seq`` out of the scheduler and give back its blocks and adapter slot."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.free(seq)
        self._unbind(seq)
        seq.status = Status.FINISHED

    def _unbind(self, seq: Sequence) -> None:
        if seq.lora_slot is not None:
            self.adapters.release(seq.lora_slot)
            seq.lora_slot = None
