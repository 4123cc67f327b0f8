"""Hot-set batch form: a request whose adapter cannot be seated waits for its load without
holding back one whose adapter is resident, and an idle engine keeps no seat for traffic that
has not come.

Two seats: tenant A's pinned ``a0`` and tenant B's hot ``b1``, which no request needs now. A
holds its share of the seats (one of two), so it may not evict B's hot adapter for ``a2`` while
the engine is busy."""

from __future__ import annotations

from dataclasses import replace

from lora_guard.plugins import Defer, Load
from lora_guard.plugins.state import EngineState, RequestView, SlotView, steps_left
from lora_guard.policies.hot_set import HotSetPolicy

NOW = 100.0


def policy() -> HotSetPolicy:
    hot_set = HotSetPolicy()
    hot_set.lora_guard_configure({"max_loras": 2, "hot_set_size": 1})
    return hot_set


def state(running: int) -> EngineState:
    return EngineState(
        step=10,
        now=NOW,
        slots=(SlotView(0, "b1", 0, 90.0, True, 4), SlotView(1, "a0", running, 99.0, False, 4)),
        host_adapters=("a2",),
        loading=frozenset(),
        memory_watermark=0.1,
        num_waiting=2,
        num_running=running,
        heat={"b1": 9, "a0": 5, "a2": 1},
        tenant_heat={("B", "b1"): 9, ("A", "a0"): 5, ("A", "a2"): 1},
        pinned=frozenset({"a0"}),
        adapter_pages={"a0": 4, "a2": 4, "b1": 4},
        pool_pages=100,
    )


def request(rid: str, adapter: str, tenant: str, arrived: float) -> RequestView:
    return RequestView(rid, adapter, tenant, 8, 0, arrived, 3, max_new_tokens=8)


OLD_A2 = request("old-a2", "a2", "A", NOW - 1.0)  # waited 1 s: not yet max_adapter_wait_s
NEW_B1 = request("new-b1", "b1", "B", NOW - 0.5)


def test_a_request_that_cannot_be_seated_does_not_hold_back_a_resident_adapters_request() -> None:
    running = [request("run-a0", "a0", "A", NOW - 2.0)]
    chosen = policy().lora_guard_batch_form([OLD_A2, NEW_B1], running, state(running=1))
    assert "new-b1" in chosen
    decision = policy().lora_guard_adapter_load(OLD_A2, "warm", state(running=1), parked=False)
    assert isinstance(decision, Defer), "B's hot adapter is protected while the engine is busy"


def test_an_idle_engine_lets_the_oldest_request_take_an_idle_hot_seat() -> None:
    chosen = policy().lora_guard_batch_form([OLD_A2], [], state(running=0))
    assert chosen == ["old-a2"]
    decision = policy().lora_guard_adapter_load(OLD_A2, "warm", state(running=0), parked=False)
    assert decision == Load(0)


def busy_seats(b1_refs: int) -> EngineState:
    """Both seats in use by running requests: tenant B's hot ``b1`` and tenant C's cooler
    ``c1``."""
    return EngineState(
        step=10,
        now=NOW,
        slots=(SlotView(0, "b1", b1_refs, 99.0, True, 4), SlotView(1, "c1", 2, 99.0, True, 4)),
        host_adapters=("a2",),
        loading=frozenset(),
        memory_watermark=0.1,
        num_waiting=3,
        num_running=2 + b1_refs,
        heat={"b1": 9, "c1": 3, "a2": 1},
        tenant_heat={("B", "b1"): 9, ("C", "c1"): 3, ("A", "a2"): 1},
        adapter_pages={"c1": 4, "a2": 4, "b1": 4},
        pool_pages=100,
    )


def test_an_aged_request_drains_the_seat_it_takes_while_streams_keep_every_seat_busy() -> None:
    aged = request("aged-a2", "a2", "A", NOW - 9.0)  # past max_adapter_wait_s (8 s)
    waiting = [aged, request("new-b1", "b1", "B", NOW - 0.2), request("new-c1", "c1", "C", NOW)]
    running = [
        request(f"run-{a}-{i}", a, a[0].upper(), NOW - 1.0) for a in ("b1", "c1") for i in (0, 1)
    ]
    # c1 has the least heat per page: its new requests wait; b1's keep coming
    assert policy().lora_guard_batch_form(waiting, running, busy_seats(b1_refs=2)) == ["new-b1"]
    # once c1's running requests have ended, its seat goes to the aged request
    busy = busy_seats(b1_refs=2)
    seated = replace(busy, slots=(busy.slots[0], SlotView(1, "c1", 0, 99.0, True, 4)))
    still_running = [r for r in running if r.adapter_id == "b1"]
    chosen = policy().lora_guard_batch_form(waiting, still_running, seated)
    assert chosen[0] == "aged-a2"
    decision = policy().lora_guard_adapter_load(aged, "warm", seated, parked=False)
    assert decision == Load(1)


def test_a_resident_adapters_request_never_waits_behind_a_load_in_flight() -> None:
    """``a2`` is being read from disk; the request behind it, for resident ``b1``, goes this step,
    with no cap on the batch's adapters and with a cap of two (``a0``'s running request takes
    one; the read in flight takes none)."""
    running = [request("run-a0", "a0", "A", NOW - 2.0)]
    loading = replace(state(running=1), loading=frozenset({"a2"}), host_adapters=())
    for cap in (0, 2):
        hot_set = policy()
        hot_set.max_loras_per_batch = cap
        chosen = hot_set.lora_guard_batch_form([OLD_A2, NEW_B1], running, loading)
        assert "new-b1" in chosen and "old-a2" in chosen, cap  # a2's read holds no place


def test_a_turn_at_full_seats_only_for_a_request_ending_before_a_seated_ones() -> None:
    # Both seats hold adapters whose running requests have 40 (b1) and 300 (c1) steps left, and
    # their quantum is over (evictable).
    full = replace(
        busy_seats(b1_refs=1),
        slots=(SlotView(0, "b1", 1, 99.0, True, 4), SlotView(1, "c1", 1, 99.0, True, 4)),
        steps_left=steps_left(
            [
                RequestView("run-b1", "b1", "B", 8, 10, NOW - 1, 0, max_new_tokens=50),
                RequestView("run-c1", "c1", "C", 8, 0, NOW - 1, 0, max_new_tokens=299),
            ]
        ),
    )
    assert full.steps_left == {"b1": 40, "c1": 300}
    short = RequestView("short-a2", "a2", "A", 8, 0, NOW - 0.1, 0, max_new_tokens=4)
    long = RequestView("long-a2", "a2", "A", 8, 0, NOW - 0.1, 0, max_new_tokens=400)
    # a 4-token request ends before either seat frees: it takes a turn at the seat of the
    # colder adapter (c1: heat 3 against b1's 9)
    decision = policy().lora_guard_adapter_load(short, "warm", full, parked=False)
    assert isinstance(decision, Load) and decision.slot == 1
    # so does a 200-token one, which ends before c1's request
    medium = replace(short, max_new_tokens=200)
    assert isinstance(policy().lora_guard_adapter_load(medium, "warm", full, parked=False), Load)
    # a 400-token one would park a request that ends sooner than it: it waits for b1's seat,
    # free in 40 steps, and gets no seat now
    assert not isinstance(policy().lora_guard_adapter_load(long, "warm", full, parked=False), Load)
    # once it has waited max_adapter_wait_s it takes a turn all the same
    aged = replace(long, arrival_time=NOW - 9.0)
    assert isinstance(policy().lora_guard_adapter_load(aged, "warm", full, parked=False), Load)


def test_no_request_is_held_back_for_pages_it_would_need_without_a_seat_cap() -> None:
    """A pool all but full of the running batch's KV and adapter pages: the request for a cold
    adapter is offered all the same and waits for its adapter's room at load time, where LRU
    waits too (holding it at batch form cost the `pressure` tail 1.29x LRU's)."""
    hot_set = HotSetPolicy()
    hot_set.lora_guard_configure({})  # the defaults: no seat cap
    full = replace(
        state(running=1),
        slots=(SlotView(0, "a0", 1, 99.0, False, 4),),
        pinned=frozenset(),
        free_pages=1,
        kv_share=0.95,
        pool_pages=100,
    )
    running = [replace(request("run-a0", "a0", "A", NOW - 2.0), num_prompt_tokens=1500)]
    waiting = [request("new-a2", "a2", "A", NOW - 0.5), request("new-a0", "a0", "A", NOW - 0.2)]
    assert hot_set.lora_guard_batch_form(waiting, running, full) == ["new-a2", "new-a0"]
    decision = hot_set.lora_guard_adapter_load(waiting[0], "warm", full, parked=False)
    assert isinstance(decision, Defer), "no room but a running adapter's: it waits for its load"
