"""``lora-guard simulate``: many replicas and many adapters, routers compared on one trace.

A discrete-event model of engine replicas, each with ``slots`` adapter seats, one loader and
continuous batching, behind a router. Costs come from the engine's measurements (``Costs``): a
step costs a fixed part, a part per sequence, a part per MiB of adapter weights the batch reads
and a part per prompt token it prefills; a load costs a fixed part and a part per MiB. A replica
evicts its least recently used adapter that no running request needs; a request whose adapter is
not resident waits for its load. Routers see the replicas as a Ray router does: queue lengths at
once, resident adapters as last pushed (every ``stats_period_s``).

Routers: ``lora-guard`` (``serve_ray.ranking``: affinity, room to load, spread, reserved loads),
``ray-multiplex`` (Ray Serve's multiplexed ranking: replicas that report the model, then those with
the fewest models, power of two choices within a rank) and ``power-of-two`` (no affinity).
"""

from __future__ import annotations

import argparse
import heapq
import math
import random
import sys
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from lora_guard.bench.stats import percentile
from lora_guard.serve_ray.ranking import AffinityRanker, ReplicaView

ROUTERS = ("lora-guard", "ray-multiplex", "power-of-two")


@dataclass(frozen=True)
class Costs:
    """Engine costs in milliseconds. The defaults are the demo model's on a 2-core CPU in float32,
    from docs/benchmarks.md (engine speed: decode steps at batch 8 and 32, the mixed step's extra
    over its adapters' bytes, prefill; round-2 run: host-to-pool loads of its adapters)."""

    step_ms: float = 74.0
    step_per_seq_ms: float = 1.85
    step_per_adapter_mib_ms: float = 0.33
    prefill_per_token_ms: float = 1.37
    load_ms: float = 5.0
    load_per_mib_ms: float = 1.25
    adapter_mib: float = 24.0  # one adapter's weights

    def step(self, num_seqs: int, num_adapters: int, prefill_tokens: int) -> float:
        return (self.step_ms + self.step_per_seq_ms * num_seqs
                + self.step_per_adapter_mib_ms * self.adapter_mib * num_adapters
                + self.prefill_per_token_ms * prefill_tokens)  # fmt: skip

    def load(self) -> float:
        return self.load_ms + self.load_per_mib_ms * self.adapter_mib


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
    first_token: float | None = None
    finish: float | None = None
    remaining: int = 0
    prefilled: bool = False


@dataclass
class Replica:
    replica_id: str
    slots: int
    max_num_seqs: int
    costs: Costs
    quantum_s: float
    resident: OrderedDict[str, float] = field(default_factory=OrderedDict)  # -> loaded at
    active: list[Outcome] = field(default_factory=list)  # in arrival order
    loading: str | None = None
    stepping: bool = False
    retry_at: float | None = None  # when a seat's quantum ends, if a load waits for it
    loads: int = 0

    @property
    def queue_len(self) -> int:
        return len(self.active)

    def free_seats(self) -> int:
        return self.slots - len(self.resident) - (self.loading is not None)

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
    """The replicas and what happens in them: the engine's step-level residency. A request whose
    adapter is out waits (parked, its KV kept); the loader brings in the adapter of the oldest
    waiting request, evicting the least recently used adapter that has been resident for at
    least the quantum (one no request needs first)."""

    def __init__(self, replicas: list[Replica], events: _Events) -> None:
        self.replicas, self.events = replicas, events

    def arrive(self, replica: Replica, outcome: Outcome, now: float) -> None:
        outcome.replica, outcome.remaining = replica.replica_id, outcome.request.new_tokens
        outcome.hit = replica.usable(outcome)
        replica.active.append(outcome)
        self._load_next(replica, now)
        self._step(replica, now)

    def _load_next(self, replica: Replica, now: float) -> None:
        if replica.loading is not None:
            return
        wanted = next((o.request.adapter_id for o in replica.active if not replica.usable(o)),
                      None)  # fmt: skip
        if wanted is None:
            return
        if len(replica.resident) >= replica.slots:
            needed = {o.request.adapter_id for o in replica.active}
            aged = [a for a, at in replica.resident.items() if at + replica.quantum_s <= now]
            victim = next((a for a in aged if a not in needed), aged[0] if aged else None)
            if victim is None:
                first = min(replica.resident.values()) + replica.quantum_s
                if replica.retry_at is None or replica.retry_at > first:
                    replica.retry_at = first
                    self.events.at(first, lambda t: self._retry(replica, t))
                return
            del replica.resident[victim]
        replica.loading = wanted
        self.events.at(now + replica.costs.load() / 1000, lambda t: self._loaded(replica, t))

    def _retry(self, replica: Replica, now: float) -> None:
        replica.retry_at = None
        self._load_next(replica, now)

    def _loaded(self, replica: Replica, now: float) -> None:
        adapter, replica.loading = replica.loading, None
        assert adapter is not None
        replica.resident[adapter] = now
        replica.loads += 1
        self._load_next(replica, now)
        self._step(replica, now)

    def _step(self, replica: Replica, now: float) -> None:
        if replica.stepping:
            return
        batch = [o for o in replica.active if replica.usable(o)][: replica.max_num_seqs]
        if not batch:
            return
        adapters = {o.request.adapter_id for o in batch} - {None}
        for adapter in adapters:
            replica.resident.move_to_end(adapter)  # type: ignore[arg-type]
        prefill = sum(o.request.prompt_tokens for o in batch if not o.prefilled)
        duration = replica.costs.step(len(batch), len(adapters), prefill) / 1000
        replica.stepping = True
        self.events.at(now + duration, lambda t: self._stepped(replica, batch, t))

    def _stepped(self, replica: Replica, batch: list[Outcome], now: float) -> None:
        replica.stepping = False
        for outcome in batch:
            outcome.prefilled = True
            outcome.remaining -= 1
            if outcome.first_token is None:
                outcome.first_token = now
            if outcome.remaining == 0:
                outcome.finish = now
        replica.active = [o for o in replica.active if o.finish is None]
        self._load_next(replica, now)
        self._step(replica, now)


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
            ranks = [[v for v in views if adapter_id in v.resident],
                     [v for v in views if len(v.resident) == fewest], views]  # fmt: skip
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
    loads: int
    hit_rate: float
    ttft_p50_ms: float
    ttft_p95_ms: float
    busiest_share: float  # the busiest replica's share of the requests


def simulate(
    trace: Sequence[SimRequest],
    router_name: str,
    replicas: int,
    slots: int,
    costs: Costs = Costs(),
    max_num_seqs: int = 64,
    max_queue: int = 64,
    stats_period_s: float = 0.5,
    quantum_s: float = 1.0,
    seed: int = 0,
) -> SimResult:
    """Replay ``trace`` on ``replicas`` replicas behind the router ``router_name``."""
    rng = random.Random(seed)
    events = _Events()
    fleet = _Fleet(
        [Replica(f"r{i}", slots, max_num_seqs, costs, quantum_s) for i in range(replicas)], events
    )
    router: Router
    if router_name == "lora-guard":
        router = AffinityRouter()
    elif router_name in ("ray-multiplex", "power-of-two"):
        router = PowerOfTwoRouter(rng, multiplex=router_name == "ray-multiplex")
    else:
        raise ValueError(f"unknown router {router_name!r}; choose from {', '.join(ROUTERS)}")
    pushed: dict[str, tuple[frozenset[str], int]] = {}

    def push(now: float) -> None:
        for r in fleet.replicas:
            pushed[r.replica_id] = (frozenset(r.resident), r.free_seats())
        if any(o.finish is None for o in outcomes):
            events.at(now + stats_period_s, push)

    def views() -> list[ReplicaView]:
        return [ReplicaView(r.replica_id, pushed[r.replica_id][0], r.queue_len, max_queue,
                            pushed[r.replica_id][1], cold_budget_left=1)
                for r in fleet.replicas]  # fmt: skip

    def arrive(outcome: Outcome) -> Callable[[float], None]:
        def action(now: float) -> None:
            router.now = now
            chosen = router.choose(outcome.request.adapter_id, views())
            fleet.arrive(next(r for r in fleet.replicas if r.replica_id == chosen), outcome, now)

        return action

    outcomes = [Outcome(r) for r in trace]
    push(0.0)
    for outcome in outcomes:
        events.at(outcome.request.time, arrive(outcome))
    events.run()
    ttft = sorted((o.first_token - o.request.time) * 1000 for o in outcomes
                  if o.first_token is not None)  # fmt: skip
    per_replica = [sum(o.replica == r.replica_id for o in outcomes) for r in fleet.replicas]
    return SimResult(
        router=router_name,
        replicas=replicas,
        requests=len(outcomes),
        completed=sum(o.finish is not None for o in outcomes),
        loads=sum(r.loads for r in fleet.replicas),
        hit_rate=sum(o.hit for o in outcomes) / len(outcomes),
        ttft_p50_ms=percentile(ttft, 50) or 0.0,
        ttft_p95_ms=percentile(ttft, 95) or 0.0,
        busiest_share=max(per_replica) / len(outcomes),
    )


def make_sim_trace(
    adapters: int, requests: int, rate: float, seed: int = 0, zipf: float = 1.0,
    prompt_mean: float = 100.0, output_mean: float = 180.0,
) -> list[SimRequest]:  # fmt: skip
    """Poisson arrivals at ``rate`` a second, adapter ``i`` with weight ``1/(i+1)**zipf``,
    lognormal output lengths with mean ``output_mean`` (16 to 400)."""
    rng = random.Random(seed)
    ids = [f"a{i:04d}" for i in range(adapters)]
    weights = [1 / (i + 1) ** zipf for i in range(adapters)]
    sigma = 0.6
    mu = math.log(output_mean) - sigma**2 / 2
    now, trace = 0.0, []
    for n in range(requests):
        now += rng.expovariate(rate)
        adapter = rng.choices(ids, weights=weights)[0]
        prompt = max(1, round(rng.expovariate(1 / prompt_mean)))
        new = min(400, max(16, round(rng.lognormvariate(mu, sigma))))
        trace.append(SimRequest(n, now, adapter, prompt, new))
    return trace


def replica_capacity(
    costs: Costs, prompt_mean: float, output_mean: float, batch: int = 16
) -> float:
    """Requests a second one replica serves at ``batch`` at once, one adapter."""
    seconds = (
        costs.step(batch, 1, 0) * output_mean + costs.prefill_per_token_ms * prompt_mean * batch
    ) / 1000
    return batch / seconds


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="lora-guard simulate", description=__doc__.split("\n")[0])
    parser.add_argument("--adapters", type=int, default=1000)
    parser.add_argument("--replicas", default="8,16,64", help="comma-separated replica counts")
    parser.add_argument("--slots", type=int, default=8, help="adapter seats per replica")
    parser.add_argument("--requests", type=int, default=20000)
    parser.add_argument("--load", type=float, default=0.7, help="share of the fleet's capacity")
    parser.add_argument("--zipf", type=float, default=1.0)
    parser.add_argument("--routers", default=",".join(ROUTERS))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    costs = Costs()
    routers = [r.strip() for r in args.routers.split(",") if r.strip()]
    print("| replicas | router | loads per 1000 requests | hit rate | TTFT p50 ms | TTFT p95 ms "
          "| busiest replica's share |")  # fmt: skip
    print("|---:|---|---:|---:|---:|---:|---:|")
    for replicas in (int(n) for n in args.replicas.split(",")):
        rate = args.load * replicas * replica_capacity(costs, 100.0, 180.0)
        trace = make_sim_trace(args.adapters, args.requests, rate, args.seed, args.zipf)
        for name in routers:
            result = simulate(trace, name, replicas, args.slots, costs, seed=args.seed)
            print(f"| {replicas} | {name} | {1000 * result.loads / result.requests:.0f} | "
                  f"{result.hit_rate:.2f} | {result.ttft_p50_ms:.0f} | {result.ttft_p95_ms:.0f} "
                  f"| {result.busiest_share:.2f} |", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
