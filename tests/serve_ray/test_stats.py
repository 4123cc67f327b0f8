"""What a replica reports to the router (``routing_stats``) and how the router reads it."""

from __future__ import annotations

from pathlib import Path

from lora_guard import LLM, SamplingParams
from lora_guard.demo.testing import AdapterFactory
from lora_guard.routing import AffinityRanker
from lora_guard.serve_ray.stats import (
    UNREPORTED_FREE_SEATS,
    adapter_of,
    replica_view,
    room,
    routing_stats,
)


def test_a_replica_reports_its_residents_seats_budget_and_loads(
    tiny_model: Path, tiny_adapters: AdapterFactory
) -> None:
    adapters = tiny_adapters(3, "rs")
    llm = LLM(
        tiny_model,
        adapters=dict(adapters),
        max_loras=2,
        kv_cache_memory="4MiB",
        device="cpu",
        dtype="float32",
        settings={"pin": "rs-00"},
    )
    try:
        before = routing_stats(llm.engine)
        assert before["resident"] == [] and before["free_seats"] == before["seats"] == 2
        assert before["loads"] == 0 and before["cold_budget_left"] == 6
        llm.generate("hello there", SamplingParams(max_new_tokens=2), "rs-00")
        llm.generate("hello there", SamplingParams(max_new_tokens=2), "rs-01")
        after = routing_stats(llm.engine)
    finally:
        llm.engine.shutdown()
    assert after["resident"] == ["rs-00", "rs-01"] and after["free_seats"] == 0
    assert after["pinned"] == ["rs-00"] and "rs-00" in after["hot_set"]
    assert after["loads"] == 2 and after["adapter_bytes"] > 0 and after["queue"] == 0
    # Loads into free seats evict nothing: the cold-load budget is untouched.
    assert after["cold_budget_left"] == 6 and after["retry_after_s"] == 0
    assert "lora_guard_adapter_lookups_total" in after["metrics"]


def test_the_router_reads_reported_stats_and_its_own_queue_count() -> None:
    stats = {"resident": ["a"], "free_seats": 2, "cold_budget_left": 0, "queue": 7, "seats": 4}
    view = replica_view("r0", stats, queue_len=3, max_queue=16)
    assert view.resident == {"a"} and view.free_seats == 2 and view.cold_budget_left == 0
    assert view.queue_len == 3  # the router's own count wins over the last report
    assert replica_view("r0", stats, None, 16).queue_len == 7
    # No cold-load budget on the replica: it may always load.
    assert replica_view("r0", {**stats, "cold_budget_left": None}, None, 16).cold_budget_left > 0
    fresh = replica_view("r1", {}, None, 16)
    assert fresh.resident == frozenset() and fresh.free_seats == UNREPORTED_FREE_SEATS


def test_reported_stats_rank_residency_first_and_reserve_seats_for_cold_loads() -> None:
    ranker = AffinityRanker(spread_queue=8)
    holder = replica_view("holder", {"resident": ["a"], "free_seats": 0}, 1, 16)
    room = replica_view("room", {"resident": [], "free_seats": 1}, 0, 16)
    assert ranker.rank("a", [room, holder]) == [["holder"], ["room"]]
    # A cold request for b reserves the only free seat of "room" ...
    assert ranker.rank("b", [room, holder])[0] == ["room"]
    ranker.routed("b", room)
    # ... so b's next request follows it, and c finds no room left without an eviction.
    assert ranker.rank("b", [room, holder])[0] == ["room"]
    assert ranker.room(room) == 0
    assert ranker.rank("c", [room, holder]) == [["room", "holder"]]  # tier: budget left
    # Once "room" reports b resident, the reservation is spent and its seat is b's.
    reported = replica_view("room", {"resident": ["b"], "free_seats": 0}, 1, 16)
    assert ranker.holds(reported, "b") and ranker.room(reported) == 0


def test_the_multiplexed_model_id_names_tenant_and_adapter() -> None:
    assert adapter_of("acme:support-v2") == "support-v2"
    assert adapter_of("") is None and adapter_of(None) is None and adapter_of("acme:") is None


def test_room_is_free_seats_under_a_cap_and_free_pool_bytes_without_one() -> None:
    assert room(4, free_seats=2, resident=2, adapter_bytes=200, free_bytes=10_000) == 2
    # No cap: as many adapters as the free pages hold, at the residents' mean size.
    assert room(0, free_seats=1, resident=2, adapter_bytes=200, free_bytes=350) == 3
    assert room(0, free_seats=1, resident=2, adapter_bytes=200, free_bytes=50) == 0
    assert room(0, free_seats=1, resident=0, adapter_bytes=0, free_bytes=10_000) == 1
