"""The adapter-affinity ranking of replicas, and the simulator that replays routers on it."""

from __future__ import annotations

import pytest

from lora_guard.routing import AffinityRanker, ReplicaView
from lora_guard.simulate import ROUTERS, SimRequest, make_sim_trace, simulate


def view(
    name: str,
    resident: set[str] = frozenset(),
    queue: int = 0,
    free: int = 0,
    budget: int = 0,
    max_queue: int = 8,
    loads: int = 0,
) -> ReplicaView:
    return ReplicaView(name, frozenset(resident), queue, max_queue, free, budget, loads)


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def test_replicas_rank_by_residency_then_room_then_budget_then_the_rest() -> None:
    replicas = [
        view("full-no-budget", queue=0),
        view("budget", budget=2, queue=0),
        view("room", free=1, queue=3),
        view("resident-busy", {"a"}, queue=5),
        view("resident", {"a"}, queue=1),
        view("resident-overloaded", {"a"}, queue=8),
    ]
    tiers = AffinityRanker(spread_queue=16).rank("a", replicas)
    assert tiers == [
        ["resident", "resident-busy"],
        ["room"],
        ["budget"],
        ["full-no-budget", "resident-overloaded"],
    ]


def test_a_hot_adapter_spreads_to_replicas_with_room_when_its_queues_grow() -> None:
    replicas = [view("holder", {"a"}, queue=4), view("room", free=2, queue=0)]
    assert AffinityRanker(spread_queue=4).rank("a", replicas)[0] == ["room", "holder"]
    assert AffinityRanker(spread_queue=5).rank("a", replicas)[0] == ["holder"]


def test_the_ranker_remembers_only_the_adapters_its_replicas_hold_or_load() -> None:
    clock = Clock()
    ranker = AffinityRanker(reservation_s=1.0, clock=clock)
    for i in range(500):  # a stream of adapters, each used once, each evicted after
        replica = view("r0", {f"a{i}"}, free=0)
        ranker.rank(f"a{i}", [replica])
        ranker.routed(f"a{i}", replica)
        clock.now += 2.0
    ranker.rank("a499", [view("r0", {"a499"})])
    assert len(ranker._last_routed) <= 2


def test_a_routed_cold_load_is_reserved_until_the_replica_reports_it_or_it_expires() -> None:
    clock = Clock()
    ranker = AffinityRanker(reservation_s=10.0, clock=clock)
    replicas = [view("r0", free=1), view("r1", free=1, queue=1)]
    first = ranker.rank("a", replicas)[0][0]
    ranker.routed("a", next(r for r in replicas if r.replica_id == first))
    # A second request for the same adapter, before r0 reports it, follows the first.
    assert ranker.rank("a", replicas)[0] == ["r0"]
    clock.now = 11.0
    assert ranker.rank("a", replicas)[0] == ["r0", "r1"]  # the reservation lapsed


def test_a_load_into_a_full_replica_evicts_what_was_routed_there_least_recently() -> None:
    ranker = AffinityRanker(spread_queue=16)
    full = view("r0", {"a", "b"}, loads=2)
    other = view("r1", {"x", "y"}, queue=1, loads=2)
    for adapter in ("a", "b", "a"):
        ranker.routed(adapter, full)
    ranker.routed("c", full)  # r0 has no room: b, routed there least recently, leaves
    # Until r0 reports again, a request for b no longer counts r0 as holding it ...
    assert ranker.rank("b", [full, other]) == [["r0", "r1"]]
    assert ranker.rank("a", [full, other])[0] == ["r0"]
    assert ranker.room(full) == 0  # c takes the seat b leaves
    # ... and once a report taken after the load says b is still there, it is believed.
    reported = view("r0", {"a", "b"}, loads=3)
    assert ranker.rank("b", [reported, other])[0] == ["r0"]


def test_the_base_model_goes_to_the_shortest_queue() -> None:
    replicas = [view("r0", queue=3), view("r1", queue=1)]
    assert AffinityRanker().rank(None, replicas) == [["r1", "r0"]]


def test_concurrent_cold_requests_load_an_adapter_once_with_reservations() -> None:
    # Two requests for one adapter 10 ms apart, before any residency push: Ray's multiplexed
    # ranking sees no replica with it and sends the second wherever power of two says.
    trace = [SimRequest(i, 0.01 * i, "a", 8, 16) for i in range(2)]
    assert simulate(trace, "lora-guard", replicas=2, slots=2).loads == 1
    # Power of two sends the second to the emptier replica, which loads the adapter again.
    assert simulate(trace, "ray-multiplex", replicas=2, slots=2).loads == 2


def test_every_simulated_request_finishes_and_affinity_loads_less_than_no_affinity() -> None:
    trace = make_sim_trace(adapters=40, requests=400, rate=4.0, seed=1, output_mean=32)
    results = {name: simulate(trace, name, replicas=4, slots=4) for name in ROUTERS}
    for result in results.values():
        assert result.completed == result.requests == 400 and result.ttft_p95_ms > 0
    assert results["lora-guard"].loads < results["power-of-two"].loads
    assert results["lora-guard"].hit_rate > results["power-of-two"].hit_rate


def test_one_replica_leaves_no_choice() -> None:
    trace = make_sim_trace(adapters=10, requests=100, rate=2.0, seed=2, output_mean=24)
    loads = {simulate(trace, name, replicas=1, slots=3).loads for name in ROUTERS}
    assert len(loads) == 1


def test_an_unknown_router_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown router"):
        simulate([SimRequest(0, 0.0, None, 4, 16)], "random", replicas=1, slots=1)
