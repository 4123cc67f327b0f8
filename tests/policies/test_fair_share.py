"""Hot-set's fair share: a tenant that already holds its share of the seats may not evict another
tenant's hot adapters; it may take another tenant's cold seat, or its own."""

from __future__ import annotations

from lora_guard.plugins import Defer, Load
from lora_guard.plugins.state import EngineState, RequestView, SlotView
from lora_guard.policies.hot_set import HotSetPolicy

OWNER = {"a1": "A", "a2": "A", "a3": "A", "b1": "B", "b2": "B", "b3": "B"}


def decide(seats: list[str], heat: dict[str, int], hot_set_size: int, waited: int = 0) -> object:
    """Tenant B asks for a seat for ``b3``; every seat holds an idle adapter (``seats[i]`` in seat
    i, the lower the seat the longer unused)."""
    policy = HotSetPolicy()
    policy.lora_guard_configure({"max_loras": len(seats), "hot_set_size": hot_set_size})
    state = EngineState(
        step=1, now=100.0, host_adapters=("b3",), loading=frozenset(), memory_watermark=0.1,
        num_waiting=1, num_running=0,
        slots=tuple(SlotView(i, a, 0, float(i), True) for i, a in enumerate(seats)),
        heat=heat, tenant_heat={(OWNER[a], a): n for a, n in heat.items()},
    )  # fmt: skip
    request = RequestView("r", "b3", "B", 4, 0, 99.0, waited)
    return policy.lora_guard_adapter_load(request=request, tier="warm", state=state, parked=False)


def test_a_tenant_at_its_share_evicts_its_own_adapter_not_another_tenants_hot_one() -> None:
    # All five adapters hot; B holds 2 of 4 seats (its share of 2 tenants): only b1 or b2 may go.
    heat = {"b3": 10, "a1": 9, "a2": 8, "b1": 7, "b2": 6}
    decision = decide(["a1", "a2", "b1", "b2"], heat, hot_set_size=5)
    assert decision == Load(2)  # b1: B's own, least recently used of its two


def test_a_tenant_at_its_share_may_take_another_tenants_cold_seat() -> None:
    # a3 is A's but cold (outside the hot set of 4): B may take it; A's hot a1 stays.
    heat = {"b3": 10, "b1": 9, "b2": 8, "a1": 7, "a3": 1}
    decision = decide(["a1", "a3", "b1", "b2"], heat, hot_set_size=4)
    assert decision == Load(1)


def test_a_tenant_below_its_share_may_displace_any_hot_adapter_for_a_hot_one() -> None:
    # B holds one seat of four: under its share, b3 (hot) may take A's least recently used seat.
    heat = {"b3": 10, "a1": 9, "a2": 8, "a3": 7, "b1": 6}
    assert decide(["a1", "a2", "a3", "b1"], heat, hot_set_size=5) == Load(0)


def test_a_cold_request_waits_while_every_seat_is_hot_until_it_ages() -> None:
    heat = {"a1": 9, "a2": 8, "b1": 7, "b2": 6, "b3": 1}
    assert isinstance(decide(["a1", "a2", "b1", "b2"], heat, hot_set_size=4), Defer)
    assert decide(["a1", "a2", "b1", "b2"], heat, hot_set_size=4, waited=16) == Load(0)
