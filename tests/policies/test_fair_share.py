"""Hot-set's victims: the least heat per page leaves first, and a tenant that already holds its
share of the seats may not evict another tenant's hot adapters; it may take another tenant's
cold seat, or its own."""

from __future__ import annotations

from dataclasses import replace

from lora_guard.plugins import Defer, Load
from lora_guard.plugins.state import EngineState, RequestView, SlotView
from lora_guard.policies.hot_set import HotSetPolicy

OWNER = {"a1": "A", "a2": "A", "a3": "A", "b1": "B", "b2": "B", "b3": "B"}


def decide(
    seats: list[str],
    heat: dict[str, int],
    hot_set_size: int,
    age_s: float = 1.0,
    refs: int = 0,
    evictable: bool = True,
) -> object:
    """Tenant B asks for a seat for ``b3`` while the engine runs a request; every seat holds an
    adapter (``seats[i]`` in seat i, the lower the seat the longer unused) that ``refs`` running
    requests use, ``evictable`` when its residency quantum is over."""
    policy = HotSetPolicy()
    policy.lora_guard_configure({"max_loras": len(seats), "hot_set_size": hot_set_size})
    state = EngineState(
        step=1,
        now=100.0,
        host_adapters=("b3",),
        loading=frozenset(),
        memory_watermark=0.1,
        num_waiting=1,
        num_running=1,
        slots=tuple(SlotView(i, a, refs, float(i), evictable) for i, a in enumerate(seats)),
        heat=heat,
        tenant_heat={(OWNER[a], a): n for a, n in heat.items()},
    )
    request = RequestView("r", "b3", "B", 4, 0, 100.0 - age_s, 0)
    return policy.lora_guard_adapter_load(request=request, tier="warm", state=state, parked=False)


def test_a_tenant_at_its_share_evicts_its_own_adapter_not_another_tenants_hot_one() -> None:
    # All five adapters hot; B holds 2 of 4 seats (its share of 2 tenants): A's adapters have
    # the least heat, but only b1 or b2 may go, and b2 has less heat than b1.
    heat = {"b3": 10, "a1": 2, "a2": 3, "b1": 7, "b2": 6}
    assert decide(["a1", "a2", "b1", "b2"], heat, hot_set_size=5) == Load(3)


def test_a_tenant_at_its_share_may_take_another_tenants_cold_seat() -> None:
    # a3 is A's but cold (outside the hot set of 4): B may take it; A's hot a1 stays.
    heat = {"b3": 10, "b1": 9, "b2": 8, "a1": 7, "a3": 1}
    assert decide(["a1", "a3", "b1", "b2"], heat, hot_set_size=4) == Load(1)


def test_a_tenant_below_its_share_may_displace_any_hot_adapter() -> None:
    # B holds one seat of four: under its share, b3 takes the seat with the least heat, A's a1.
    heat = {"b3": 10, "b1": 9, "a2": 8, "a3": 7, "a1": 6}
    assert decide(["a1", "a2", "a3", "b1"], heat, hot_set_size=5) == Load(0)


def test_when_every_seat_is_busy_adapters_take_turns_at_the_quantum() -> None:
    heat = {"a1": 9, "a2": 8, "b1": 7, "b2": 6, "b3": 1}
    seats = ["a1", "a2", "b1", "b2"]
    # Every seat's adapter runs requests and is within its residency quantum: b3 waits.
    assert isinstance(decide(seats, heat, hot_set_size=4, refs=1, evictable=False), Defer)
    # Their quantum is over: the least valuable seat goes, its requests parked for a turn.
    assert decide(seats, heat, hot_set_size=4, refs=1) == Load(3)
    # So does a request that waited max_adapter_wait_s (8 s).
    assert decide(seats, heat, hot_set_size=4, refs=1, age_s=8.0) == Load(3)


def test_a_request_waits_for_a_colder_busy_seat_rather_than_evict_a_hot_idle_adapter() -> None:
    # Seats bind, so heat per seat decides, not per page. a1 is busy but colder than every idle
    # adapter, and its request ends within two steps: b3 waits for a1's seat instead of evicting
    # a hotter one that is idle right now.
    heat = {"a1": 1, "a2": 8, "b1": 7, "b2": 6, "b3": 2}
    policy = HotSetPolicy()
    policy.lora_guard_configure({"max_loras": 4, "hot_set_size": 4})
    slots = tuple(
        SlotView(i, a, int(a == "a1"), float(i), True, 4 if a == "b2" else 2)
        for i, a in enumerate(["a1", "a2", "b1", "b2"])
    )
    state = EngineState(
        step=1,
        now=100.0,
        host_adapters=("b3",),
        loading=frozenset(),
        memory_watermark=0.1,
        num_waiting=1,
        num_running=1,
        slots=slots,
        heat=heat,
        tenant_heat={(OWNER[a], a): n for a, n in heat.items()},
        steps_left={"a1": 2},
    )
    request = RequestView("r", "b3", "A", 4, 0, 99.0, 0)
    load = policy.lora_guard_adapter_load
    assert isinstance(load(request=request, tier="warm", state=state, parked=False), Defer)
    # A seat that frees only after many steps is not worth the wait: waiting costs b3 those
    # steps, an eviction costs one load if the adapter is asked again. Tenant A holds its
    # share of the seats (a1, a2), so its own a2 is the idle adapter that goes.
    later = replace(state, steps_left={"a1": 40})
    assert load(request=request, tier="warm", state=later, parked=False) == Load(1)
    # Once a1's request has ended, a1's seat is the one that goes.
    idle = replace(state, slots=(replace(slots[0], refs=0), *slots[1:]), num_running=0)
    assert load(request=request, tier="warm", state=idle, parked=False) == Load(0)
