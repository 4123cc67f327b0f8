"""Continuous batching: which sequences run in the next step, and how many tokens each.

Every step, adapters first: the adapters that parked running sequences and waiting sequences need
are brought into the pool, oldest need first, evicting adapters whose residency quantum is over
(adapter-load decisions). Then running sequences whose adapter is resident get their next tokens
(one for a decode, the next chunk for a prompt still being read); the others stay parked, their
KV kept. Then waiting sequences whose adapter is resident are admitted while the token budget, the
sequence cap and the KV pool allow. When blocks run out, the most recently admitted running
sequence is preempted: its blocks are freed and it is recomputed later.

The scheduler owns the page pool (KV blocks and adapter runs, ``page_pool.py``) and the adapters'
residency, which places adapters in the pool. It binds each sequence's prefix-cache namespace
(``lora_guard_cache_namespace``) and decides on cached blocks computed under other weights
(``lora_guard_cache_reuse``).
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable
from types import MappingProxyType

from lora_guard.clock import monotonic
from lora_guard.engine.kv_cache import Block
from lora_guard.engine.lora.checkpoint import AdapterError
from lora_guard.engine.lora.seats import Resident
from lora_guard.engine.lora.tiers import Lookup, Need, Residency
from lora_guard.engine.page_pool import PagePool
from lora_guard.engine.sequence import CacheScope, Sequence, Status
from lora_guard.engine.step_plan import Failure, ScheduledSeq, SchedulerOutput
from lora_guard.plugins.decisions import Defer, Load, Reject
from lora_guard.plugins.manager import Hooks
from lora_guard.plugins.state import EngineState, steps_left


class Scheduler:
    def __init__(
        self,
        pages: PagePool,
        adapters: Residency,
        hooks: Hooks,
        model_id: str,
        max_batch_tokens: int,
        max_num_seqs: int,
        reject_when_busy: bool = True,
        clock: Callable[[], float] = monotonic,
    ) -> None:
        self.pages, self.blocks = pages, pages.blocks  # KV blocks and adapter runs; the blocks
        self.adapters, self.hooks, self.model_id = adapters, hooks, model_id
        self.reject_when_busy, self.clock = reject_when_busy, clock
        self.max_batch_tokens, self.max_num_seqs = max_batch_tokens, max_num_seqs
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_steps = 0
        self.num_preemptions = 0
        self._state: EngineState | None = None

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)
        if seq.adapter_id is not None and self.adapters.arrived(seq):
            self._state = None  # its files changed on disk: read again
        need = self.adapters.need(seq)
        if seq.adapter_id is not None and need is not None and not need.ready:
            seq.adapter_needed_at = self.clock()  # its wait for the adapter begins now

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def state(self, *, fresh: bool = False) -> EngineState:
        """A read-only view of the engine for the hooks, taken once per scheduling pass."""
        if self._state is None or fresh:
            adapters, usage, now = self.adapters, self.adapters.usage, self.clock()
            running = Counter(s.adapter_id for s in self.running if s.adapter_id)
            self._state = EngineState(
                step=self.num_steps,
                now=now,
                slots=adapters.slot_views(running, now),
                host_adapters=tuple(adapters.host.entries),
                loading=frozenset(adapters.loader.pending),
                num_parked=sum(1 for s in self.running if s.parked_since is not None),
                adapters_changed_on_disk=adapters.stats.changed_on_disk,
                num_waiting=len(self.waiting),
                num_running=len(self.running),
                registered=frozenset(adapters.registry.entries),
                waiting_adapters=tuple(s.adapter_id for s in self.waiting if s.adapter_id),
                running_adapters=tuple(s.adapter_id for s in self.running if s.adapter_id),
                heat=MappingProxyType(usage.heat(now)),
                tenant_heat=MappingProxyType(usage.tenant_heat(now)),
                pinned=frozenset(usage.pinned),
                cold_loads_in_window=usage.disk_reads.total(now),
                evicting_loads=usage.evicting_loads.times(now),
                num_preemptions=self.num_preemptions,
                adapter_pages=MappingProxyType(
                    adapters.pages_by_adapter(
                        {s.adapter_id for s in (*self.running, *self.waiting) if s.adapter_id}
                    )
                ),
                **self.pages.occupancy(),
                adapter_ranks=MappingProxyType(adapters.ranks()),
                steps_left=MappingProxyType(steps_left(s.view() for s in self.running)),
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
        offered = [by_id.pop(i) for i in chosen if i in by_id]
        now = self.clock()
        for seq in offered:
            seq.hold(now, False)
        for seq in by_id.values():
            seq.hold(now, True)
        return offered

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        self._state = None
        for adapter_id, error in self.adapters.poll().items():
            for seq in [s for s in (*self.waiting, *self.running) if s.adapter_id == adapter_id]:
                self.finish(seq)
                out.failed.append(Failure(seq, str(error)))
        waiting = self.order_waiting()
        self.adapters.begin_step(
            Counter(s.adapter_id for s in (*self.running, *self.waiting) if s.adapter_id),
            Counter((s.adapter_id, s.adapter_hash) for s in self.running),
        )
        self._bring_in_adapters(out, waiting)
        budget = self._schedule_running(out, self.max_batch_tokens)
        self._schedule_waiting(out, waiting, budget)
        if not out.scheduled and self.running and self.adapters.short_of_pages:
            # Every running request is parked and their KV leaves no room for the adapters
            # they need: the newest gives its blocks back and is recomputed later.
            victim = self.running[-1]
            self.preempt(victim)
            out.preempted.append(victim)
        for seq in self.waiting:
            seq.waited_steps += 1
        self.num_steps += 1
        out.copies, self.blocks.pending_copies = self.blocks.pending_copies, []
        return out

    def advance(self, out: SchedulerOutput) -> None:
        """The step ran: its tokens are computed, and the blocks they filled are published."""
        for item in out.scheduled:
            item.seq.num_computed_tokens += item.num_new_tokens
            self.blocks.commit(item.seq)

    def end_step(self) -> None:
        """The step is over, run or failed: no request computes with any adapter now."""
        self.adapters.end_step()

    # prefix cache
    def bind_cache(self, seq: Sequence, content_hash: str | None) -> None:
        """Set ``seq``'s prefix-cache scope (the weights its KV is computed under) and namespace
        (the key its blocks are shared by: the scope, unless a plugin says otherwise)."""
        scope = CacheScope(self.model_id, seq.adapter_id, content_hash)
        namespace = None
        if self.hooks.has("lora_guard_cache_namespace"):
            namespace = self.hooks.cache_namespace(
                request=seq.view(), base_model_id=self.model_id, adapter_hash=content_hash
            )
        seq.cache_scope = scope
        seq.cache_namespace = scope if namespace is None else namespace

    def may_reuse(self, block: Block, seq: Sequence) -> bool:
        """Whether ``seq`` may reuse a cached block computed under other weights."""
        return self.hooks.cache_reuse(
            request=seq.view(), block_scope=block.scope, request_scope=seq.cache_scope
        )

    def _bring_in_adapters(self, out: SchedulerOutput, waiting: list[Sequence]) -> None:
        """Bring in the adapters that parked and waiting sequences need, the oldest need first."""
        now = self.clock()

        def needs(seq: Sequence) -> bool:
            need = self.adapters.need(seq)
            if need is None or need.ready:
                return False
            if seq.adapter_needed_at is None:
                seq.adapter_needed_at = now
            return True

        # Oldest need first; waiting ones that began to wait together keep batch form's order.
        needing = sorted(
            filter(needs, [*self.running, *waiting]), key=lambda s: s.adapter_needed_at or now
        )
        tried: set[str | None] = set()
        for seq in needing:
            if seq.adapter_id in tried or seq.status is Status.FINISHED:
                continue
            tried.add(seq.adapter_id)
            parked = seq.status is Status.RUNNING
            need = self.adapters.need(seq)
            assert need is not None
            if parked and self.adapters.version_gone(need):
                # Its weights were replaced while it was parked: start it again under the new
                # ones rather than mix two versions in one KV.
                self.preempt(seq)
                out.preempted.append(seq)
                parked = False
                need = self.adapters.need(seq)
                assert need is not None
            try:
                self._bring_in(seq, parked, need)
            except AdapterError as exc:
                for other in [
                    s for s in (*self.running, *self.waiting) if s.adapter_id == seq.adapter_id
                ]:
                    self.finish(other)
                    out.failed.append(Failure(other, str(exc)))
            except _Rejected as rejected:
                self.finish(seq)
                out.failed.append(Failure(seq, rejected.reason, rejected.retry_after))

    def _bring_in(self, seq: Sequence, parked: bool, need: Need) -> None:
        """Ask the policies, then the pool, for ``seq``'s adapter (adapter-load decisions)."""
        tier = self.adapters.lookup(need)
        self._note_lookup(seq, tier)
        how = Load()  # the engine chooses the seat
        asks = need.adapter_id is not None and tier in (Lookup.WARM, Lookup.COLD)
        if asks and self.hooks.has("lora_guard_adapter_load"):
            decision = self.hooks.adapter_load(
                request=seq.view(),
                tier=tier.value,
                state=self.state(),
                parked=parked,
                evicts=self.adapters.load_evicts(need),
            )
            if isinstance(decision, Defer):
                return
            if isinstance(decision, Reject):
                if parked or not self.reject_when_busy:
                    return  # a running request, or an offline batch, waits instead
                raise _Rejected(decision.reason, decision.retry_after)
            if isinstance(decision, Load):
                how = decision
        if tier is Lookup.LOADING:
            return
        if self.adapters.bring_in(need, how, self.running, parked):
            self._state = None  # the weights changed

    def _note_lookup(self, seq: Sequence, tier: Lookup) -> None:
        if seq.adapter_id is None or seq.adapter_looked_up or tier is Lookup.LOADING:
            return
        seq.adapter_looked_up = True
        self.adapters.stats.lookups[tier] += 1
        self.hooks.notify("lora_guard_adapter_lookup", request=seq.view(), result=tier.value)

    def _ready(self, seq: Sequence, need: Need | None) -> bool:
        """Whether ``seq`` can compute this step (``need``: where its weights stand)."""
        if need is None:
            return True
        if not need.ready:
            if seq.status is Status.RUNNING and seq.parked_since is None:
                seq.parked_since = seq.adapter_needed_at = self.clock()
            return False
        if seq.adapter_id is None:
            seq.adapter_needed_at = None
        elif seq.adapter_needed_at is not None or seq.parked_since is not None:
            started = seq.adapter_needed_at or seq.parked_since or self.clock()
            wait_ms = (self.clock() - started) * 1000
            if seq.first_token_time is None:
                seq.first_adapter_wait_s += wait_ms / 1000
            seq.adapter_needed_at = seq.parked_since = None
            self.hooks.notify("lora_guard_adapter_ready", request=seq.view(), wait_ms=wait_ms)
        elif not seq.adapter_ready_once:
            self.hooks.notify("lora_guard_adapter_ready", request=seq.view(), wait_ms=0.0)
        seq.adapter_ready_once = True
        return True

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            need = self.adapters.need(seq)
            if not self._ready(seq, need):
                i += 1  # parked: its KV stays, its adapter comes back in a later step
                continue
            entry = need.resident if need is not None else None
            n = min(seq.num_uncomputed_tokens, budget)
            self.adapters.make_room(self.blocks.to_append(seq, n), keep=entry)
            while not self.blocks.can_append(seq, n):
                if self.adapters.evict_for_kv(keep=entry):
                    self._state = None
                    continue  # an adapter's pages first, before anyone's KV
                victim = self.running[-1]
                self.preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            else:
                self.blocks.append(seq, n)
                out.scheduled.append(ScheduledSeq(seq, n, entry))
                if need is not None:
                    self.adapters.use(need)
                budget -= n
                i += 1
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, waiting: list[Sequence], budget: int) -> None:
        for seq in waiting:
            if budget <= 0 or len(self.running) >= self.max_num_seqs:
                break
            if seq.status is not Status.WAITING:
                continue  # failed or rejected this step
            need = self.adapters.need(seq)
            if need is not None:
                self._note_lookup(seq, self.adapters.lookup(need))
            if not self._ready(seq, need):
                continue  # its adapter is loading or deferred; the others go on
            entry = need.resident if need is not None else None
            content_hash = need.content_hash if need is not None else None
            if entry is not None and self._never_fits(seq, entry):
                self.finish(seq)
                out.failed.append(Failure(seq, self._too_long(seq)))
                continue
            self.bind_cache(seq, content_hash)
            pages, reused = self.blocks.allocation(seq, budget, self.may_reuse)
            self.adapters.make_room(pages, keep=entry, protect=reused)
            while not self.blocks.fits(pages, reused):
                if not self.adapters.evict_for_kv(keep=entry):
                    break
                self._state = None
            if not self.blocks.fits(pages, reused):
                break
            seq.adapter_hash = content_hash
            self._admit(out, seq, budget, entry)
            if need is not None:
                self.adapters.use(need)
            budget = self.max_batch_tokens - out.num_tokens

    def _too_long(self, seq: Sequence) -> str:
        return (
            f"the prompt and max_new_tokens with adapter {seq.adapter_id!r} need more than the "
            f"cache pool's {self.blocks.num_blocks} pages"
        )

    def _never_fits(self, seq: Sequence, entry: Resident) -> bool:
        tokens = seq.num_prompt_tokens + seq.params.max_new_tokens
        return self.blocks.blocks_for(tokens) + entry.num_pages > self.blocks.num_blocks

    def _admit(
        self, out: SchedulerOutput, seq: Sequence, budget: int, entry: Resident | None
    ) -> None:
        self.blocks.allocate(seq, self.may_reuse)
        n = min(seq.num_uncomputed_tokens, budget)
        self.blocks.append(seq, n)
        self.waiting.remove(seq)
        seq.status = Status.RUNNING
        self.running.append(seq)
        out.scheduled.append(ScheduledSeq(seq, n, entry))

    def preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.free(seq)
        seq.status = Status.WAITING
        seq.adapter_hash = seq.parked_since = None
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence) -> None:
        """Take ``seq`` out of the scheduler and give back its blocks and adapter slot."""
        seq.hold(self.clock(), False)
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.free(seq)
        seq.status = Status.FINISHED

    def check_no_leaks(self) -> None:
        """Raise AssertionError unless no sequence is left and no block or slot is held."""
        blocks, adapters = self.blocks, self.adapters
        assert blocks.num_used_blocks == 0, f"{blocks.num_used_blocks} KV blocks leaked"
        held = sum(e.in_step for e in adapters.residents())
        assert held == 0, f"{held} adapter references leaked"
        pages = sum(e.num_pages for e in adapters.residents())
        assert pages == len(blocks.reserved), (
            f"adapter pages leaked: {pages} in residents, {len(blocks.reserved)} reserved"
        )
        assert not self.has_work(), "scheduler still holds sequences"


class _Rejected(Exception):
    def __init__(self, reason: str, retry_after: float) -> None:
        super().__init__(reason)
        self.reason, self.retry_after = reason, retry_after
