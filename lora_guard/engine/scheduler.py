"""Continuous batching: which sequences run in the next step, and how many tokens each.

Every step, running sequences come first (one token for a decode, the next chunk for a prompt
still being read), then waiting ones are admitted while the token budget, the sequence cap, the
KV pool and their adapter allow. When blocks run out, the most recently admitted running sequence
is preempted: its blocks are freed and it is recomputed later.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from types import MappingProxyType

from lora_guard.engine.adapter_manager import AdapterManager, Lookup
from lora_guard.engine.kv_cache import BlockManager
from lora_guard.engine.lora import AdapterError
from lora_guard.engine.sequence import Sequence, Status
from lora_guard.plugins.decisions import Defer, Load, Reject
from lora_guard.plugins.manager import Hooks
from lora_guard.plugins.state import EngineState, SlotView

WINDOW_S = 60.0  # of the heat and cold-load counts in the state view

# Sets a sequence's prefix-cache namespace and scope once its adapter's weights are known.
CacheBinder = Callable[[Sequence, str | None], None]


@dataclass(slots=True)
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int


@dataclass(slots=True)
class Failure:
    """A request the scheduler could not serve; ``retry_after`` is set for a busy answer."""

    seq: Sequence
    reason: str
    retry_after: float | None = None


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    failed: list[Failure] = field(default_factory=list)

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
        hooks: Hooks,
    ) -> None:
        self.blocks, self.adapters, self.bind_cache = blocks, adapters, bind_cache
        self.max_batch_tokens, self.max_num_seqs = max_batch_tokens, max_num_seqs
        self.hooks = hooks
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_steps = 0
        self.num_preemptions = 0
        self._state: EngineState | None = None
        self._arrivals: deque[tuple[float, str]] = deque()  # (time, adapter id), for the heat
        self._heat: Counter[str] = Counter()

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)
        if seq.adapter_id is not None:
            self._arrivals.append((time.monotonic(), seq.adapter_id))
            self._heat[seq.adapter_id] += 1

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def state(self, *, fresh: bool = False) -> EngineState:
        """A read-only view of the engine for the hooks, taken once per scheduling pass."""
        if self._state is None or fresh:
            adapters, now = self.adapters, time.monotonic()
            while self._arrivals and self._arrivals[0][0] <= now - WINDOW_S:
                self._heat[self._arrivals.popleft()[1]] -= 1
            self._state = EngineState(
                step=self.num_steps,
                now=now,
                slots=tuple(
                    SlotView(i, s.adapter_id, s.refs, s.last_used)
                    for i, s in enumerate(adapters.slots)
                ),
                host_adapters=tuple(adapters.host.entries),
                loading=frozenset(adapters.loader.pending),
                memory_watermark=self.blocks.num_used_blocks / self.blocks.num_blocks,
                num_waiting=len(self.waiting),
                num_running=len(self.running),
                registered=frozenset(adapters.registry),
                waiting_adapters=tuple(s.adapter_id for s in self.waiting if s.adapter_id),
                running_adapters=tuple(s.adapter_id for s in self.running if s.adapter_id),
                heat=MappingProxyType({a: n for a, n in self._heat.items() if n > 0}),
                cold_loads_in_window=adapters.cold_loads_since(now - WINDOW_S),
                num_preemptions=self.num_preemptions,
            )
        return self._state

    def order_waiting(self) -> list[Sequence]:
        """The waiting sequences offered a place this step, in order (batch-form decisions)."""
        if not self.hooks.has("lora_guard_batch_form"):
            return list(self.waiting)
        chosen = self.hooks.batch_form(
            waiting=[s.view() for s in self.waiting],
            running=[s.view() for s in self.running],
            state=self.state(),
        )
        if chosen is None:
            return list(self.waiting)
        by_id = {s.request_id: s for s in self.waiting}
        return [by_id.pop(i) for i in chosen if i in by_id]

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        self._state = None
        for adapter_id, error in self.adapters.poll().items():
            for seq in [s for s in self.waiting if s.adapter_id == adapter_id]:
                self.waiting.remove(seq)
                out.failed.append(Failure(seq, str(error)))
        budget = self._schedule_running(out, self.max_batch_tokens)
        self._schedule_waiting(out, budget)
        for seq in self.waiting:
            seq.waited_steps += 1
        self.num_steps += 1
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
            try:
                bound, content_hash = self._bind_adapter(seq)
            except AdapterError as exc:
                self.waiting.remove(seq)
                out.failed.append(Failure(seq, str(exc)))
                continue
            except _Rejected as rejected:
                self.waiting.remove(seq)
                out.failed.append(Failure(seq, rejected.reason, rejected.retry_after))
                continue
            if not bound:
                continue  # its adapter is loading or deferred; the others go on
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

    def _bind_adapter(self, seq: Sequence) -> tuple[bool, str | None]:
        """Give ``seq`` its adapter slot (adapter-load decisions); False means wait."""
        if seq.adapter_id is None and not self.adapters.merged_mode:
            return True, None
        if seq.adapter_id is None:
            binding = self.adapters.acquire(None)
            if binding is None:
                return False, None
            seq.lora_slot, seq.holds_adapter = None, True
            return True, None
        tier = self.adapters.tier(seq.adapter_id)
        slot = None
        if tier in (Lookup.WARM, Lookup.COLD) and self.hooks.has("lora_guard_adapter_load"):
            decision = self.hooks.adapter_load(
                request=seq.view(), tier=tier.value, state=self.state()
            )
            if isinstance(decision, Defer):
                return False, None
            if isinstance(decision, Reject):
                raise _Rejected(decision.reason, decision.retry_after)
            if isinstance(decision, Load):
                slot = decision.slot
        if not seq.adapter_looked_up and tier is not Lookup.LOADING:
            seq.adapter_looked_up = True
            self.hooks.notify("lora_guard_adapter_lookup", request=seq.view(), result=tier.value)
        binding = self.adapters.acquire(seq.adapter_id, slot)
        if binding is None:
            return False, None
        self._state = None  # the slots changed
        seq.lora_slot, seq.holds_adapter = binding.slot, True
        return True, binding.content_hash

    def preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.free(seq)
        self._unbind(seq)
        seq.status = Status.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
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
        if seq.holds_adapter:
            self.adapters.release(seq.lora_slot)
            seq.lora_slot, seq.holds_adapter = None, False


class _Rejected(Exception):
    def __init__(self, reason: str, retry_after: float) -> None:
        super().__init__(reason)
        self.reason, self.retry_after = reason, retry_after
