"""One simulation: a trace through a router onto a fleet, and what it measured."""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from lora_guard.routing import ReplicaView
from lora_guard.simulate.fleet import Events, Fleet, Outcome, Replica, SimRequest
from lora_guard.simulate.routers import make_router
from lora_guard.simulate_costs import Costs
from lora_guard.workload.stats import percentile
from lora_guard.workload.trace import WorkloadSpec, make_trace, mean_rate

if TYPE_CHECKING:
    from lora_guard.workload.trace import TraceRequest

DEFAULT_COSTS = Costs()


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


class Reports:
    """What the router knows of each replica's pool: its resident adapters and free seats as it
    last reported them (``ReplicaView``'s), queue lengths being the router's own at once.

    With ``tick_s`` 0 every replica reports every ``period_s``, all at once, seen at once. With
    ``tick_s`` > 0 they report as Ray Serve's controller has them report: it polls on ticks of
    ``tick_s`` (its control loop), starts a replica's ``record_routing_stats`` once ``period_s``
    times a random 0.9 to 1.1 has passed since it started the last one, each replica from its own
    start, and the router sees the report on the next tick."""

    def __init__(
        self,
        fleet: Fleet,
        events: Events,
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
    ``router_name``, each starting as :meth:`Replica.start_with` says.

    ``clients`` 0: each request is sent at its time; N > 0: a closed loop of N clients, each
    sending the trace's next request once its last is answered, the first ones at 0.
    ``overhead_ms``: each request's time outside the engine (HTTP, the router, the hops), half
    before it reaches its replica, half after its last token; latencies and TTFT are from its
    sending to its client. ``spread_queue``: the ``lora-guard`` router's. ``stats_period_s``,
    ``stats_tick_s``: how the replicas report their pools (``Reports``)."""
    rng = random.Random(seed)
    events = Events()
    half_s = overhead_ms / 2000
    outcomes = [Outcome(r) for r in trace]
    pending = iter(outcomes[clients:] if clients else ())

    def finished(outcome: Outcome, now: float) -> None:
        outcome.answered = now + half_s
        following = next(pending, None)
        if following is not None:
            events.at(outcome.answered, send(following))

    fleet = Fleet([], events, finished)
    for i in range(replicas):
        replica = Replica(
            f"r{i}", slots, max_num_seqs, costs, quantum_s, host_slots, max_batch_tokens
        )
        replica.start_with(start_resident, start_host)
        fleet.replicas.append(replica)
    router = make_router(router_name, rng, spread_queue)

    def unfinished() -> bool:
        return any(o.finish is None for o in outcomes)

    reports = Reports(fleet, events, stats_period_s, stats_tick_s, rng, unfinished)

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


def _result(name: str, fleet: Fleet, outcomes: list[Outcome], half_s: float) -> SimResult:
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
