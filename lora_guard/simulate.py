"""``lora-guard simulate``: many replicas and many adapters, routers compared on one trace.

A discrete-event model of engine replicas behind a router, step by step as the engine schedules
(``engine/scheduler.py``, ``engine/lora/residency.py``). Each step first brings in the adapters
that waiting and parked requests need, the oldest need first: an adapter in host memory is
written into the pool during the step (a free seat, else the least recently used adapter no
request needs, else the one whose residency quantum is over); one on disk is read on the loader
thread, one at a time, into host memory (``host_slots`` adapters, LRU). Then running requests
whose adapter is resident get their next tokens (parked ones keep their place), and waiting ones
whose adapter is resident are admitted while ``max_num_seqs`` and the token budget allow.

A step costs a fixed part, a part per sequence, a part per MiB of adapter weights the batch
reads and a part per prompt token it prefills, plus the pool writes of its loads (``Costs``,
measured on the engine by ``lora-guard simulate --calibrate``). Routers see the replicas as a Ray
router does: queue lengths at once, resident adapters as last pushed (every ``stats_period_s``;
with ``stats_tick_s``, as Ray Serve's controller polls each replica). Clients send each request
at its time (open loop) or, with ``clients``, one after another (closed loop), each request
spending ``overhead_ms`` outside the engine (HTTP, the router, the hops).

Routers: ``lora-guard`` (``serve_ray.ranking``: affinity, room to load, spread, reserved loads),
``ray-multiplex`` (Ray Serve's multiplexed ranking: replicas that report the model, then those with
the fewest models, power of two choices within a rank) and ``power-of-two`` (no affinity).

Not modelled: the guard policies (hot set, cold-load budget: the replicas decide as the ``lru``
policy does), the KV pool's size (no preemption), the prefix cache.
"""

from __future__ import annotations

import argparse
import heapq
import math
import random
import sys
from collections import OrderedDict
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from lora_guard.cost_profiles import PROFILES, profile, profiles_help
from lora_guard.plugins.eviction import ResidentView, eviction_order
from lora_guard.routing import AffinityRanker, ReplicaView
from lora_guard.simulate_costs import Costs, read_costs
from lora_guard.workload.stats import percentile
from lora_guard.workload.trace import WorkloadSpec, make_trace, mean_rate

if TYPE_CHECKING:
    from lora_guard.workload.trace import TraceRequest

ROUTERS = ("lora-guard", "ray-multiplex", "power-of-two")
DEFAULT_COSTS = Costs()


@dataclass(frozen=True)
class SimRequest:
    id: int
    time: float  # seconds
    adapter_id: str | None
    prompt_tokens: int
    new_tokens: int


@dataclass
class Outcome:
    request: SimRequest
    replica: str = ""
    hit: bool = False  # its adapter was resident on its replica when it arrived
    sent: float = 0.0  # when its client sent it
    first_token: float | None = None
    finish: float | None = None  # its last token, on its replica
    answered: float | None = None  # when its client has the answer
    computed: int = 0  # prompt tokens computed
    generated: int = 0
    needed_since: float | None = None  # since when it waits for its adapter (the engine's order)


@dataclass
class _Seat:
    loaded_at: float
    last_used: float


@dataclass
class Replica:
    replica_id: str
    slots: int
    max_num_seqs: int
    costs: Costs
    quantum_s: float
    host_slots: int = 32
    max_batch_tokens: int = 2048
    resident: OrderedDict[str, _Seat] = field(default_factory=OrderedDict)  # least recent first
    host: OrderedDict[str, None] = field(default_factory=OrderedDict)  # least recent first
    running: list[Outcome] = field(default_factory=list)  # admitted, in admission order
    waiting: list[Outcome] = field(default_factory=list)  # in arrival order
    reads: list[str] = field(default_factory=list)  # queued for the loader, the first being read
    stepping: bool = False
    retry_at: float | None = None  # when a seat's quantum ends, if a load waits for it
    loads: int = 0  # pool writes (the engine's adapter loads)
    disk_reads: int = 0

    @property
    def queue_len(self) -> int:
        return len(self.running) + len(self.waiting)

    def free_seats(self) -> int:
        return self.slots - len(self.resident)

    def usable(self, outcome: Outcome) -> bool:
        return outcome.request.adapter_id is None or outcome.request.adapter_id in self.resident


class _Events:
    def __init__(self) -> None:
        self.heap: list[tuple[float, int, Callable[[float], None]]] = []
        self.count = 0

    def at(self, time: float, action: Callable[[float], None]) -> None:
        self.count += 1
        heapq.heappush(self.heap, (time, self.count, action))

    def run(self) -> None:
        while self.heap:
            time, _, action = heapq.heappop(self.heap)
            action(time)


class _Fleet:
    """The replicas and what happens in them, one engine step at a time; ``finished`` is told
    of each request as its last token comes."""

    def __init__(
        self,
        replicas: list[Replica],
        events: _Events,
        finished: Callable[[Outcome, float], None] = lambda _o, _t: None,
    ) -> None:
        self.replicas, self.events, self.finished = replicas, events, finished

    def arrive(self, replica: Replica, outcome: Outcome, now: float) -> None:
        outcome.replica = replica.replica_id
        outcome.hit = replica.usable(outcome)
        replica.waiting.append(outcome)
        self._wake(replica, now)

    def _wake(self, replica: Replica, now: float) -> None:
        """Form and start the next step, unless one is running or nothing can run."""
        if replica.stepping:
            return
        write_ms = self._bring_in(replica, now)
        batch, prefill = self._batch(replica)
        # Used in the batch's order, as the engine marks them (the last the most recent).
        adapters = list(
            dict.fromkeys(
                o.request.adapter_id for o, _ in batch if o.request.adapter_id is not None
            )
        )
        for adapter in adapters:
            replica.resident[adapter].last_used = now
            replica.resident.move_to_end(adapter)
        if not batch and not write_ms:
            self._retry_later(replica, now)
            return  # idle until an arrival, a finished read or a quantum's end
        duration = write_ms
        if batch:
            duration += replica.costs.step(len(batch), len(adapters), prefill)
        replica.stepping = True
        self.events.at(now + duration / 1000, lambda t: self._stepped(replica, batch, t))

    def _retry_later(self, replica: Replica, now: float) -> None:
        """An idle replica whose parked or waiting requests need a seat that no adapter may
        leave yet tries again when the first quantum ends (the engine polls each step)."""
        if any(not replica.usable(o) for o in (*replica.running, *replica.waiting)):
            first = min((s.loaded_at for s in replica.resident.values()), default=now)
            at = max(first + replica.quantum_s, now)
            if at > now and (replica.retry_at is None or replica.retry_at > at):
                replica.retry_at = at
                self.events.at(at, lambda t: self._retry(replica, t))

    def _retry(self, replica: Replica, now: float) -> None:
        replica.retry_at = None
        self._wake(replica, now)

    def _bring_in(self, replica: Replica, now: float) -> float:
        """Load the adapters waiting and parked requests need, oldest need first; returns the
        milliseconds of pool writes this step makes."""
        needing = []
        for o in (*replica.running, *replica.waiting):
            if not replica.usable(o):
                if o.needed_since is None:
                    o.needed_since = now
                needing.append(o)
        needing.sort(key=lambda o: o.needed_since or now)
        demand = {o.request.adapter_id for o in (*replica.running, *replica.waiting)}
        write_ms, tried = 0.0, set()
        for outcome in needing:
            adapter = outcome.request.adapter_id
            assert adapter is not None
            if adapter in tried:
                continue
            tried.add(adapter)
            if adapter not in replica.host:
                self._read(replica, adapter, now)
                continue
            if len(replica.resident) >= replica.slots and not self._evict(replica, demand, now):
                continue
            replica.host.move_to_end(adapter)
            replica.resident[adapter] = _Seat(now, now)
            replica.loads += 1
            write_ms += replica.costs.write()
        return write_ms

    def _evict(self, replica: Replica, demand: Collection[str | None], now: float) -> bool:
        """Free a seat with the engine's own choice (``plugins.eviction.eviction_order``); False
        when none may leave."""
        views = [
            ResidentView(a, seat.last_used, seat.loaded_at, needed=a in demand)
            for a, seat in replica.resident.items()
        ]
        order = eviction_order(views, now, replica.quantum_s)
        if not order:
            return False
        del replica.resident[order[0]]
        return True

    def _read(self, replica: Replica, adapter: str, now: float) -> None:
        if adapter in replica.reads:
            return
        replica.reads.append(adapter)
        if len(replica.reads) == 1:
            self.events.at(now + replica.costs.read() / 1000, lambda t: self._read_done(replica, t))

    def _read_done(self, replica: Replica, now: float) -> None:
        adapter = replica.reads.pop(0)
        replica.disk_reads += 1
        replica.host[adapter] = None
        replica.host.move_to_end(adapter)
        while len(replica.host) > replica.host_slots:
            replica.host.popitem(last=False)
        if replica.reads:
            self.events.at(now + replica.costs.read() / 1000, lambda t: self._read_done(replica, t))
        self._wake(replica, now)

    def _batch(self, replica: Replica) -> tuple[list[tuple[Outcome, int]], int]:
        """The step's sequences with their new tokens, and its prefill tokens."""
        budget, batch, prefill = replica.max_batch_tokens, [], 0
        for outcome in replica.running:
            if budget <= 0:
                break
            if replica.usable(outcome):
                n = min(_uncomputed(outcome), budget)
                batch.append((outcome, n))
                budget -= n
        admitted: list[Outcome] = []
        for outcome in replica.waiting:
            if budget <= 0 or len(replica.running) + len(admitted) >= replica.max_num_seqs:
                break
            if replica.usable(outcome):
                n = min(_uncomputed(outcome), budget)
                batch.append((outcome, n))
                admitted.append(outcome)
                budget -= n
        if admitted:
            taken = {id(o) for o in admitted}
            replica.waiting = [o for o in replica.waiting if id(o) not in taken]
            replica.running.extend(admitted)
        for outcome, n in batch:
            outcome.needed_since = None
            if outcome.computed < outcome.request.prompt_tokens:
                prefill += n
        return batch, prefill

    def _stepped(self, replica: Replica, batch: list[tuple[Outcome, int]], now: float) -> None:
        replica.stepping = False
        for outcome, n in batch:
            prompt = outcome.request.prompt_tokens
            if outcome.computed < prompt:
                outcome.computed += n
                if outcome.computed < prompt:
                    continue  # a chunk of its prompt: no token yet
            outcome.generated += 1
            if outcome.first_token is None:
                outcome.first_token = now
            if outcome.generated >= outcome.request.new_tokens:
                outcome.finish = now
                self.finished(outcome, now)
        replica.running = [o for o in replica.running if o.finish is None]
        self._wake(replica, now)


def _uncomputed(outcome: Outcome) -> int:
    return max(outcome.request.prompt_tokens - outcome.computed, 1)


class Router(Protocol):
    now: float  # the simulated time, set before each choice

    def choose(self, adapter_id: str | None, views: list[ReplicaView]) -> str: ...


class AffinityRouter:
    def __init__(self, spread_queue: int = 4) -> None:
        self.ranker = AffinityRanker(spread_queue=spread_queue, clock=lambda: self.now)
        self.now = 0.0

    def choose(self, adapter_id: str | None, views: list[ReplicaView]) -> str:
        chosen = self.ranker.rank(adapter_id, views)[0][0]
        self.ranker.routed(adapter_id, next(v for v in views if v.replica_id == chosen))
        return chosen


class PowerOfTwoRouter:
    """Ray Serve's default: two random replicas that are not overloaded, the shorter queue; with
    ``multiplex``, tried first among the replicas that report the model, then among those with
    the fewest models, then among all."""

    def __init__(self, rng: random.Random, multiplex: bool) -> None:
        self.rng, self.multiplex, self.now = rng, multiplex, 0.0

    def choose(self, adapter_id: str | None, views: list[ReplicaView]) -> str:
        ranks = [views]
        if self.multiplex and adapter_id is not None:
            fewest = min(len(v.resident) for v in views)
            ranks = [
                [v for v in views if adapter_id in v.resident],
                [v for v in views if len(v.resident) == fewest],
                views,
            ]
        for rank in ranks:
            open_ = [v for v in rank if v.queue_len < v.max_queue]
            if open_:
                pair = self.rng.sample(open_, min(2, len(open_)))
                return min(pair, key=lambda v: v.queue_len).replica_id
        return min(views, key=lambda v: v.queue_len).replica_id


@dataclass(frozen=True)
class SimResult:
    router: str
    replicas: int
    requests: int
    completed: int
    loads: int  # adapter loads into the pool, all replicas
    hit_rate: float  # share of requests whose adapter was resident on arrival
    ttft_p50_ms: float
    ttft_p95_ms: float
    busiest_share: float  # the busiest replica's share of the requests
    latency_p50_ms: float = 0.0  # arrival to last token
    latency_p95_ms: float = 0.0
    disk_reads: int = 0  # adapters read from disk into host memory, all replicas
    loads_per_replica: tuple[int, ...] = ()


class _Reports:
    """What the router knows of each replica's pool: its resident adapters and free seats as it
    last reported them (``ReplicaView``'s), queue lengths being the router's own at once.

    With ``tick_s`` 0 every replica reports every ``period_s``, all at once, seen at once. With
    ``tick_s`` > 0 they report as Ray Serve's controller has them report: it polls on ticks of
    ``tick_s`` (its control loop), starts a replica's ``record_routing_stats`` once ``period_s``
    times a random 0.9 to 1.1 has passed since it started the last one, each replica from its own
    start, and the router sees the report on the next tick."""

    def __init__(
        self,
        fleet: _Fleet,
        events: _Events,
        period_s: float,
        tick_s: float,
        rng: random.Random,
        running: Callable[[], bool],
    ) -> None:
        self.fleet, self.events, self.period_s, self.tick_s = fleet, events, period_s, tick_s
        self.rng, self.running = rng, running
        self.seen: dict[str, tuple[frozenset[str], int, int]] = {}

    def start(self) -> None:
        for replica in self.fleet.replicas:
            self.seen[replica.replica_id] = _snapshot(replica)
        if self.tick_s <= 0:
            self.events.at(self.period_s, self._all)
            return
        for replica in self.fleet.replicas:  # each began reporting when it started
            phase = self.tick_s * self.rng.randrange(max(round(self.period_s / self.tick_s), 1))
            self.events.at(phase, self._one(replica))

    def view(self, replica: Replica, max_queue: int) -> ReplicaView:
        resident, free, loads = self.seen[replica.replica_id]
        return ReplicaView(
            replica.replica_id, resident, replica.queue_len, max_queue, free, 1, loads
        )

    def _all(self, now: float) -> None:
        for replica in self.fleet.replicas:
            self.seen[replica.replica_id] = _snapshot(replica)
        if self.running():
            self.events.at(now + self.period_s, self._all)

    def _one(self, replica: Replica) -> Callable[[float], None]:
        def report(now: float) -> None:
            snapshot = _snapshot(replica)
            self.events.at(now + self.tick_s, lambda _t: self._see(replica, snapshot))
            if self.running():  # the next on the first tick past the drawn period
                wait = self.period_s * self.rng.uniform(0.9, 1.1)
                self.events.at(now + self.tick_s * math.ceil(wait / self.tick_s), report)

        return report

    def _see(self, replica: Replica, snapshot: tuple[frozenset[str], int, int]) -> None:
        self.seen[replica.replica_id] = snapshot


def _snapshot(replica: Replica) -> tuple[frozenset[str], int, int]:
    return frozenset(replica.resident), replica.free_seats(), replica.loads


def simulate(
    trace: Sequence[SimRequest],
    router_name: str,
    replicas: int,
    slots: int,
    costs: Costs = DEFAULT_COSTS,
    max_num_seqs: int = 64,
    max_queue: int = 64,
    stats_period_s: float = 0.5,
    quantum_s: float = 1.0,
    seed: int = 0,
    *,
    host_slots: int = 32,
    max_batch_tokens: int = 2048,
    start_resident: Sequence[str] = (),
    start_host: Sequence[str] = (),
    spread_queue: int = 4,
    clients: int = 0,
    overhead_ms: float = 0.0,
    stats_tick_s: float = 0.0,
) -> SimResult:
    """Replay ``trace`` on ``replicas`` replicas of ``slots`` adapter seats behind the router
    ``router_name``. Every replica starts with ``start_resident`` in its pool (the last ones
    if they are more than the seats) and ``start_host`` in host memory.

    ``clients`` 0: each request is sent at its time. ``clients`` > 0: a closed loop, that many
    clients each sending the trace's next request once its last one is answered (the trace's
    times unused), the first ones at 0. ``overhead_ms``: each request's time outside the engine
    (the client's HTTP, the router, the hops there and back), half before it reaches its
    replica, half after its last token; latencies and TTFT are from its sending to its client.
    ``spread_queue``: the ``lora-guard`` router's (``AffinityRanker``'s). ``stats_period_s``,
    ``stats_tick_s``: how the replicas report their pools (``_Reports``)."""
    rng = random.Random(seed)
    events = _Events()
    half_s = overhead_ms / 2000
    outcomes = [Outcome(r) for r in trace]
    pending = iter(outcomes[clients:] if clients else ())

    def finished(outcome: Outcome, now: float) -> None:
        outcome.answered = now + half_s
        following = next(pending, None)
        if following is not None:
            events.at(outcome.answered, send(following))

    fleet = _Fleet([], events, finished)
    for i in range(replicas):
        replica = Replica(
            f"r{i}", slots, max_num_seqs, costs, quantum_s, host_slots, max_batch_tokens
        )
        for adapter in [*start_host, *start_resident][-host_slots:]:
            replica.host[adapter] = None
        for adapter in list(start_resident)[-slots:]:
            replica.resident[adapter] = _Seat(-quantum_s, -quantum_s)
        fleet.replicas.append(replica)
    router: Router
    if router_name == "lora-guard":
        router = AffinityRouter(spread_queue)
    elif router_name in ("ray-multiplex", "power-of-two"):
        router = PowerOfTwoRouter(rng, multiplex=router_name == "ray-multiplex")
    else:
        raise ValueError(f"unknown router {router_name!r}; choose from {', '.join(ROUTERS)}")
    reports = _Reports(
        fleet,
        events,
        stats_period_s,
        stats_tick_s,
        rng,
        lambda: any(o.finish is None for o in outcomes),
    )

    def send(outcome: Outcome) -> Callable[[float], None]:
        def action(now: float) -> None:
            outcome.sent = now
            if half_s:
                events.at(now + half_s, arrive(outcome))
            else:
                arrive(outcome)(now)

        return action

    def arrive(outcome: Outcome) -> Callable[[float], None]:
        def action(now: float) -> None:
            router.now = now
            views = [reports.view(r, max_queue) for r in fleet.replicas]
            chosen = router.choose(outcome.request.adapter_id, views)
            fleet.arrive(next(r for r in fleet.replicas if r.replica_id == chosen), outcome, now)

        return action

    reports.start()
    for outcome in outcomes[:clients] if clients else outcomes:
        events.at(0.0 if clients else outcome.request.time, send(outcome))
    events.run()
    return _result(router_name, fleet, outcomes, half_s)


def _result(name: str, fleet: _Fleet, outcomes: list[Outcome], half_s: float) -> SimResult:
    ttft = [(o.first_token + half_s - o.sent) * 1000 for o in outcomes if o.first_token is not None]
    latency = [(o.answered - o.sent) * 1000 for o in outcomes if o.answered is not None]
    per_replica = [sum(o.replica == r.replica_id for o in outcomes) for r in fleet.replicas]
    return SimResult(
        router=name,
        replicas=len(fleet.replicas),
        requests=len(outcomes),
        completed=len(latency),
        loads=sum(r.loads for r in fleet.replicas),
        hit_rate=sum(o.hit for o in outcomes) / max(len(outcomes), 1),
        ttft_p50_ms=percentile(ttft, 50) or 0.0,
        ttft_p95_ms=percentile(ttft, 95) or 0.0,
        busiest_share=max(per_replica) / max(len(outcomes), 1),
        latency_p50_ms=percentile(latency, 50) or 0.0,
        latency_p95_ms=percentile(latency, 95) or 0.0,
        disk_reads=sum(r.disk_reads for r in fleet.replicas),
        loads_per_replica=tuple(r.loads for r in fleet.replicas),
    )


def sim_requests(
    trace: Sequence[TraceRequest], prompt_tokens: Callable[[str], int] | None = None
) -> list[SimRequest]:
    """The bench's trace (``bench/workload``) as the simulator's requests. ``prompt_tokens``
    counts a prompt's tokens (a tokenizer's); by default its words, about one token each."""
    count = prompt_tokens or (lambda text: len(text.split()))
    return [
        SimRequest(n, r.time, r.adapter_id, max(count(r.prompt), 1), r.max_new_tokens)
        for n, r in enumerate(trace)
    ]


def make_sim_trace(
    adapters: int,
    requests: int,
    rate: float,
    seed: int = 0,
    zipf: float = 1.0,
    output_mean: float = 180.0,
) -> list[SimRequest]:
    """The bench's Zipf workload (``bench/workload.make_trace``, bursts included) over adapters
    ``a0000 ...``, at a mean of ``rate`` arrivals a second."""
    spec = WorkloadSpec(
        adapters=adapters, requests=requests, zipf=zipf, output_mean=output_mean, seed=seed
    )
    spec = replace(spec, rate=rate * spec.rate / mean_rate(spec))
    return sim_requests(make_trace(spec, [f"a{i:04d}" for i in range(adapters)]))


def replica_capacity(
    costs: Costs, prompt_mean: float, output_mean: float, batch: int = 16
) -> float:
    """Requests a second one replica serves at ``batch`` at once, one adapter."""
    seconds = (
        costs.step(batch, 1, 0) * output_mean + costs.prefill_per_token_ms * prompt_mean * batch
    ) / 1000
    return batch / seconds


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="lora-guard simulate",
        description=(__doc__ or "").split("\n")[0].split(": ", 1)[-1],
        epilog="--calibrate measures the engine's costs on this machine instead of simulating.",
    )
    parser.add_argument("--adapters", type=int, default=1000)
    parser.add_argument("--replicas", default="8,16,64", help="comma-separated replica counts")
    parser.add_argument("--slots", type=int, default=8, help="adapter seats per replica")
    parser.add_argument("--host-slots", type=int, default=32, help="adapters in host memory")
    parser.add_argument("--requests", type=int, default=20000)
    parser.add_argument("--load", type=float, default=0.7, help="share of the fleet's capacity")
    parser.add_argument("--zipf", type=float, default=1.0)
    parser.add_argument("--routers", default=",".join(ROUTERS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--profile",
        choices=PROFILES,
        default="cpu-demo",
        help=f"the costs of a model on a device (docs/simulate.md): {profiles_help()}",
    )
    parser.add_argument(
        "--costs", type=Path, help="costs JSON written by --calibrate, over the profile's"
    )
    parser.add_argument(
        "--step-log",
        type=Path,
        metavar="FILE",
        help="fit the step and write costs to a step log (lora-guard serve "
        "--step-log FILE), over --costs or the profile's",
    )
    parser.add_argument(
        "--calibrate",
        type=Path,
        metavar="OUT.json",
        help="measure the engine's costs and write them here",
    )
    parser.add_argument(
        "--adapter-dir", type=Path, help="--calibrate: adapters (default: 8 made for the run)"
    )
    # The engine --calibrate measures, with `lora-guard serve`'s flags (imported here, as they
    # import torch: this module does not). It pins the CPU and float32 where serve picks by the
    # machine: costs measured like the defaults (the demo model in float32 on a CPU,
    # docs/simulate.md), one calibration comparable with the next.
    from lora_guard.config import add_engine_flags

    calibrate = parser.add_argument_group("the engine --calibrate measures")
    add_engine_flags(
        calibrate, ["model", "device", "dtype"], defaults={"device": "cpu", "dtype": "float32"}
    )
    args = parser.parse_args(argv)
    if args.calibrate is not None:
        from lora_guard.config import engine_names
        from lora_guard.simulate_costs import calibrate_command

        device, dtype = engine_names(args.device, args.dtype)
        model = Path(args.model) if args.model is not None else None
        return calibrate_command(args.calibrate, model, args.adapter_dir, device, dtype)
    costs = read_costs(args.costs) if args.costs else profile(args.profile).costs
    if args.step_log is not None:
        costs = _fitted(costs, args.step_log)
    routers = [r.strip() for r in args.routers.split(",") if r.strip()]
    print(f"costs: {costs.source}")
    print(
        "| replicas | router | loads per 1000 requests | hit rate | TTFT p50 ms | TTFT p95 ms "
        "| busiest replica's share |"
    )
    print("|---:|---|---:|---:|---:|---:|---:|")
    for replicas in (int(n) for n in args.replicas.split(",")):
        rate = args.load * replicas * replica_capacity(costs, 100.0, 180.0)
        trace = make_sim_trace(args.adapters, args.requests, rate, args.seed, args.zipf)
        for name in routers:
            result = simulate(
                trace, name, replicas, args.slots, costs, seed=args.seed, host_slots=args.host_slots
            )
            print(
                f"| {replicas} | {name} | {1000 * result.loads / result.requests:.0f} | "
                f"{result.hit_rate:.2f} | {result.ttft_p50_ms:.0f} | {result.ttft_p95_ms:.0f} "
                f"| {result.busiest_share:.2f} |",
                flush=True,
            )
    return 0


def _fitted(costs: Costs, step_log: Path) -> Costs:
    """``costs`` with the step and write costs fitted to the steps of ``step_log``."""
    from lora_guard.simulate_costs import fit_steps, read_step_log, with_step_fit

    try:
        steps = read_step_log(step_log)
        fit = fit_steps(steps, loads=True)
    except (OSError, ValueError, TypeError) as exc:
        raise SystemExit(f"lora-guard simulate: --step-log {step_log}: {exc}") from None
    fitted = with_step_fit(costs, fit, f"{costs.source}, the step fitted to {step_log.name}")
    print(
        f"step ms = {fitted.step_ms:.3f} + {fitted.step_per_seq_ms:.4f} x sequences + "
        f"{fitted.step_per_adapter_mib_ms:.4f} x adapter MiB + "
        f"{fitted.prefill_per_token_ms:.4f} x prefill tokens + {fitted.write_ms:.3f} x loads "
        f"(over {fit.samples} steps of {step_log.name}: {100 * fit.rms_relative:.0f}% RMS "
        f"relative)"
    )
    return fitted


if __name__ == "__main__":
    sys.exit(main())
