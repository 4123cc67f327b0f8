"""lora-guard's policies as vLLM's scheduler sees them: the state view built from vLLM's requests
and LoRA seats, the hooks called as the bundled engine calls them, and the metrics they feed.

``lora_guard.vllm.Scheduler`` owns one :class:`SchedulerGuard` and asks it, before each of vLLM's
scheduling passes, which waiting requests to hold back; vLLM's own pass then schedules the rest
(its ``max_loras`` gate, token budget and KV allocation unchanged). Nothing here imports vLLM: a
request is anything with vLLM's ``Request`` attributes.

vLLM's worker keeps the adapters of the last batches in device seats and host slots;
``worker_seats.Seats`` follows them from the batches the scheduler forms, so a lookup's tier (hot,
warm, cold) is the worker's.
vLLM cannot park a running request as the bundled engine does: an adapter leaves its seat only
when no running request uses it, which hot-set's drain gives an aged request (docs/vllm.md).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

from lora_guard.clock import wall
from lora_guard.engine.lora.checkpoint import config_rank
from lora_guard.engine.usage import AdapterUsage
from lora_guard.metrics import MetricsPlugin
from lora_guard.plugins import Defer, Reject
from lora_guard.plugins.manager import Hooks
from lora_guard.plugins.state import EngineState, RequestView, SlotView, steps_left
from lora_guard.vllm import channel
from lora_guard.vllm.exposition import own_metrics
from lora_guard.vllm.kv_scope import AdapterDigests
from lora_guard.vllm.load_timer import take_timed_loads
from lora_guard.vllm.settings import configured_hooks
from lora_guard.vllm.worker_seats import Load, Seats

#: the ``vllm_xargs`` key the door puts the tenant in (vLLM's ``SamplingParams.extra_args``)
TENANT_ARG = "lora_guard_tenant"
PUBLISH_EVERY_S = 0.25
MAX_IN_FLIGHT = 8  # steps scheduled and not yet reported (async scheduling keeps one or two)


def adapter_of(request: Any) -> str | None:
    lora = request.lora_request
    return lora.lora_name if lora is not None and lora.lora_int_id > 0 else None


def tenant_of(request: Any) -> str:
    params = request.sampling_params
    extra = (params.extra_args if params is not None else None) or {}
    return str(extra.get(TENANT_ARG, "default"))


class SchedulerGuard:
    """The policies' view of one vLLM scheduler, and the hooks it calls."""

    def __init__(
        self,
        *,
        max_loras: int,
        max_cpu_loras: int,
        num_blocks: int,
        block_size: int,
        hooks: Hooks | None = None,
        folder: Path | None = None,
        clock: Any = wall,  # vLLM's arrival times are Unix seconds
    ) -> None:
        self.max_loras = max_loras
        if hooks is None:
            # vLLM budgets each step's prompt tokens itself (its chunked prefill)
            hooks, options = configured_hooks(max_loras=max_loras, prefill_tokens_per_step=0)
        else:
            options = {}
        self.hooks = hooks
        self.metrics = self.hooks.pm.get_plugin("metrics")
        self.clock = clock
        self.usage = AdapterUsage(max_loras, float(options.get("heat_window_s", 60.0)), clock)
        if options.get("pin"):
            self.usage.pin(*options["pin"])
        self.device = Seats(max_loras)
        self.host = Seats(max(max_cpu_loras, max_loras))
        self.num_blocks, self.block_size = num_blocks, block_size
        self.digests = AdapterDigests()
        self.block_scope: dict[int, tuple[str | None, str | None]] = {}
        self.kv_conflicts = self.cached_tokens = self.num_steps = 0
        self.waited_steps: Counter[str] = Counter()
        self.needed_since: dict[str, float] = {}  # request id -> when it found its adapter out
        self.looked_up: set[str] = set()
        self.step_started = 0.0
        self.in_flight: dict[int, tuple[float, list[Load]]] = {}  # id(output): start, loads
        self.folder = folder
        self.rejects = folder / channel.REJECTS_FILE if folder else None
        self.last_published = 0.0
        self.last_seats: Any = None
        self.ranks: dict[str, int] = {}  # adapter -> the rank its config states
        self.rendered_at = 0.0  # when the metrics file was last written
        self.was_busy = False
        self._state: tuple[tuple[Any, ...], EngineState] | None = None  # one view per step

    # requests
    def view(self, request: Any) -> RequestView:
        return RequestView(
            request_id=request.request_id,
            adapter_id=adapter_of(request),
            tenant_id=tenant_of(request),
            num_prompt_tokens=request.num_prompt_tokens,
            num_output_tokens=request.num_output_tokens,
            arrival_time=request.arrival_time,
            waited_steps=self.waited_steps[request.request_id],
            cache_salt=request.cache_salt,
            max_new_tokens=request.max_tokens,
        )

    def arrived(self, request: Any) -> None:
        self._state = None
        adapter = adapter_of(request)
        if adapter is not None:
            self.usage.arrived(tenant_of(request), adapter)
            path = request.lora_request.lora_path
            if adapter not in self.ranks and path:
                rank = config_rank(Path(path))
                if rank is not None:
                    self.ranks[adapter] = rank

    def serve_model(self, name: str) -> None:
        """vLLM serves ``name``: the ``model_name`` label of the residency gauges. Publishes the
        idle engine's state, so a router reads the residency gauges before any request."""
        state = self.state([], [])
        if isinstance(self.metrics, MetricsPlugin):
            self.metrics.model_name = name
            self.metrics.publish(state)
        self.publish(state)

    def state(self, waiting: list[Any], running: list[Any]) -> EngineState:
        """The policies' view, built once per step: the view taken after a step serves the next
        pass's decisions while no request arrived, finished or was scheduled since."""
        key = (
            tuple(r.request_id for r in waiting),
            tuple((r.request_id, r.num_tokens) for r in running),
        )
        if self._state is not None and self._state[0] == key:
            return self._state[1]
        state = self._build_state(waiting, running)
        self._state = (key, state)
        return state

    def _build_state(self, waiting: list[Any], running: list[Any]) -> EngineState:
        now = self.clock()
        in_use = Counter(a for a in map(adapter_of, running) if a)
        seated = {seat: a for a, seat in self.device.seat_of.items()}
        slots = tuple(
            SlotView(
                slot=seat,
                adapter_id=seated.get(seat),
                refs=in_use[seated[seat]] if seat in seated else 0,
                last_used=self.device.last_used.get(seated.get(seat, ""), 0.0),
                loaded_at=self.device.loaded_at.get(seated.get(seat, ""), 0.0),
            )
            for seat in range(self.max_loras)
        )
        kv_blocks = sum(-(-r.num_tokens // self.block_size) for r in running)
        return EngineState(
            step=self.num_steps,
            now=now,
            slots=slots,
            host_adapters=tuple(self.host.seat_of),
            loading=frozenset(),
            reads_in_background=False,
            memory_watermark=min(kv_blocks / max(self.num_blocks, 1), 1.0),
            kv_share=min(kv_blocks / max(self.num_blocks, 1), 1.0),
            num_waiting=len(waiting),
            num_running=len(running),
            waiting_adapters=tuple(a for a in map(adapter_of, waiting) if a),
            running_adapters=tuple(a for a in map(adapter_of, running) if a),
            heat=MappingProxyType(self.usage.heat(now)),
            tenant_heat=MappingProxyType(self.usage.tenant_heat(now)),
            pinned=frozenset(self.usage.pinned),
            cold_loads_in_window=self.usage.disk_reads.total(now),
            evicting_loads=self.usage.evicting_loads.times(now),
            free_pages=max(self.num_blocks - kv_blocks, 0),
            pool_pages=self.num_blocks,
            block_size=self.block_size,
            adapter_ranks=MappingProxyType(self.ranks),
            steps_left=MappingProxyType(steps_left(map(self.view, running))),
        )

    # before vLLM's pass
    def hold_back(self, waiting: list[Any], running: list[Any]) -> set[str]:
        """Ids of the waiting requests that wait this step: those batch form leaves out, and those
        whose adapter load a policy defers (or rejects: vLLM's scheduler cannot answer 429, the
        door does)."""
        self.step_started = self.clock()
        self.num_steps += 1
        for request in waiting:
            self.waited_steps[request.request_id] += 1
            if adapter_of(request) not in self.device.seat_of and adapter_of(request):
                self.needed_since.setdefault(request.request_id, self.step_started)
        if not waiting:
            return set()
        state = self.state(waiting, running)
        views = {r.request_id: self.view(r) for r in waiting}
        offered = None
        if self.hooks.has("lora_guard_batch_form"):
            offered = self.hooks.batch_form(
                waiting=list(views.values()), running=[self.view(r) for r in running], state=state
            )
        chosen = list(views) if offered is None else [i for i in offered if i in views]
        refused: set[str | None] = set()
        asked: set[str | None] = set()
        needed = set(state.running_adapters) | set(state.waiting_adapters)
        for request_id in chosen:
            view = views[request_id]
            adapter = view.adapter_id
            if adapter is None or adapter in self.device.seat_of or adapter in asked:
                continue
            asked.add(adapter)
            tier = "warm" if adapter in self.host.seat_of else "cold"
            evicts = self.device.full() and all(a in needed for a in self.device.seat_of)
            decision = self.hooks.adapter_load(
                request=view, tier=tier, state=state, parked=False, evicts=evicts
            )
            if isinstance(decision, (Defer, Reject)):
                refused.add(adapter)
        kept = {i for i in chosen if views[i].adapter_id not in refused}
        return set(views) - kept

    # after vLLM's pass
    def scheduled(self, output: Any, requests: Mapping[str, Any], unfinished: list[Any]) -> None:
        """vLLM formed a batch: the seats the worker will use, the lookups of requests scheduled
        for the first time, and the prefix-cache blocks they reuse. A load that evicts an
        adapter an ``unfinished`` request needs is thrash (``EngineState.evicting_loads``)."""
        now = self.clock()
        self._state = None  # the seats and the heat move with this batch
        batch = [requests[i] for i in output.num_scheduled_tokens if i in requests]
        adapters = {a for a in map(adapter_of, batch) if a}
        needed = {a for a in map(adapter_of, unfinished) if a}
        for new in output.scheduled_new_reqs:
            request = requests.get(new.req_id)
            if request is None:
                continue
            self._first_schedule(request, new, now)
        cold = {adapter for adapter, _, _ in self.host.use(adapters, now)}  # read from disk
        loads = []
        for adapter, seat, evicted in self.device.use(adapters, now):
            tier = "cold" if adapter in cold else "warm"
            loads.append(Load(adapter, seat, tier, evicted))
            if tier == "cold":
                self.usage.disk_reads.add(adapter)
            if evicted is not None and evicted in needed:
                self.usage.evicting_loads.add(adapter)
        self.in_flight[id(output)] = (self.step_started, loads)
        while len(self.in_flight) > MAX_IN_FLIGHT:  # outputs vLLM never reported back
            del self.in_flight[next(iter(self.in_flight))]

    def _first_schedule(self, request: Any, new: Any, now: float) -> None:
        rid = request.request_id
        adapter = adapter_of(request)
        view = self.view(request)
        if adapter is not None and rid not in self.looked_up:
            self.looked_up.add(rid)
            tier = (
                "hot"
                if adapter in self.device.seat_of
                else "warm"
                if adapter in self.host.seat_of
                else "cold"
            )
            self.hooks.notify("lora_guard_adapter_lookup", request=view, result=tier)
        since = self.needed_since.pop(rid, None)
        self.hooks.notify(
            "lora_guard_adapter_ready",
            request=view,
            wait_ms=0.0 if since is None else (now - since) * 1000,
        )
        self._check_blocks(request, new)

    def _check_blocks(self, request: Any, new: Any) -> None:
        """Count the reused prefix blocks computed under other weights than the request's
        (``lora_guard_kv_namespace_conflict``), then note the weights of its blocks."""
        adapter = adapter_of(request)
        digest = None
        if adapter is not None and request.lora_request.lora_path:
            digest = self.digests.of(Path(request.lora_request.lora_path))
        scope = (adapter, digest)
        blocks = list(new.block_ids[0]) if new.block_ids else []
        hits = new.num_computed_tokens // self.block_size
        self.cached_tokens += new.num_computed_tokens
        for block in blocks[:hits]:
            known = self.block_scope.get(block)
            if known is not None and known != scope:
                self.kv_conflicts += 1
        for block in blocks:
            self.block_scope[block] = scope

    def step_done(self, output: Any, waiting: list[Any], running: list[Any]) -> None:
        """The step ran: its loads are timed (vLLM loads an adapter inside the step that first
        uses it, so a load's time is that step's), and the state is published."""
        now = self.clock()
        started, loads = self.in_flight.pop(id(output), (now, []))
        duration_s = max(now - started, 0.0)
        timed = take_timed_loads(self.folder)
        for load in loads:
            if load.evicted is not None:
                self.hooks.notify(
                    "lora_guard_adapter_evicted", adapter_id=load.evicted, slot=load.seat
                )
            seconds = timed.get(load.adapter_id)  # the worker's own timing, where it has one
            self.hooks.notify(
                "lora_guard_adapter_loaded",
                adapter_id=load.adapter_id,
                slot=load.seat,
                tier=load.tier,
                swap_ms=1000 * (sum(seconds.values()) if seconds else duration_s),
                read_ms=1000 * (seconds or {}).get("load", 0.0),
            )
        self._take_rejects()
        state = self.state(waiting, running)
        self.hooks.notify(
            "lora_guard_step_finished",
            state=state,
            num_tokens=getattr(output, "total_num_scheduled_tokens", 0),
            duration_s=duration_s,
            kv_conflicts=self.kv_conflicts,
            cached_tokens=self.cached_tokens,
        )
        self.publish(state)

    def finished(self, request: Any, reason: str) -> None:
        self._state = None
        rid = request.request_id
        self.waited_steps.pop(rid, None)
        self.needed_since.pop(rid, None)
        self.looked_up.discard(rid)
        view = self.view(request)
        self.hooks.notify(
            "lora_guard_request_finished",
            request=view,
            finish_reason=reason,
            error=None,
            retry_after=None,
            num_cached_tokens=max(getattr(request, "num_cached_tokens", 0), 0),
        )

    # between processes
    def _take_rejects(self) -> None:
        """The door's 429s, counted as rejected cold loads."""
        if self.rejects is None:
            return
        for line in channel.take_lines(self.rejects):
            view = RequestView(
                request_id=str(line.get("request_id", "")),
                adapter_id=line.get("adapter_id"),
                tenant_id=str(line.get("tenant_id", "default")),
                num_prompt_tokens=0,
                num_output_tokens=0,
                arrival_time=float(line.get("time", 0.0)),
                waited_steps=0,
            )
            self.hooks.notify(
                "lora_guard_request_finished",
                request=view,
                finish_reason="error",
                error=str(line.get("reason", "")),
                retry_after=float(line.get("retry_after", 1.0)),
                num_cached_tokens=0,
            )

    def seats_record(self, state: EngineState) -> dict[str, Any]:
        """What the door needs: the seats, the adapters requests need, the recent loads."""
        return {
            "max_loras": self.max_loras,
            "device": list(self.device.seat_of),
            "host": list(self.host.seat_of),
            "needed": sorted({*state.running_adapters, *state.waiting_adapters}),
            "waiting_out": sorted(set(state.waiting_adapters) - set(self.device.seat_of)),
            "evicting_loads": list(state.evicting_loads),
            "busy": bool(state.num_running or state.num_waiting),
        }

    def publish(self, state: EngineState) -> None:
        if self.folder is None:
            return
        record = self.seats_record(state)
        now = self.clock()
        busy = state.num_running or state.num_waiting  # an idle engine takes no more steps
        if busy and record == self.last_seats and now - self.last_published < PUBLISH_EVERY_S:
            return
        record["time"] = now
        channel.replace_file(self.folder / channel.SEATS_FILE, json.dumps(record).encode())
        # the exposition is rendered when the door asked for it since the last rendering, and
        # once when the engine goes idle (what a later read sees)
        wanted = channel.mtime(self.folder / channel.WANTED_FILE) >= self.rendered_at
        if isinstance(self.metrics, MetricsPlugin) and (wanted or (self.was_busy and not busy)):
            channel.replace_file(self.folder / channel.METRICS_FILE, own_metrics(self.metrics))
            self.rendered_at = wall()
        del record["time"]
        self.last_seats, self.last_published, self.was_busy = record, now, bool(busy)
