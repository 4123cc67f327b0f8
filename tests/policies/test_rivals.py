"""The rivals' policies on lora-guard's hooks: each frees room in its own order, and the ones that
shape batches (drain, time-slice) hold back what their source holds back."""

from __future__ import annotations

from lora_guard.plugins import Defer, Load
from lora_guard.plugins.manager import RIVAL_POLICIES, make_plugin_manager
from lora_guard.plugins.state import EngineState, RequestView, SlotView
from lora_guard.policies.baselines import FIFOPolicy, LRUPolicy
from lora_guard.policies.drain import DrainPolicy
from lora_guard.policies.s3_fifo import S3FIFOPolicy
from lora_guard.policies.time_slice import SLICE_S, TimeSlicePolicy
from lora_guard.policies.victims import plan_load
from lora_guard.policies.w_tinylfu import WTinyLFUPolicy

PAGES = {"a": 4, "b": 4, "c": 4, "big": 8, "new": 4}


def state(
    residents: list[tuple[str, float, float]], free_pages: int = 0, now: float = 100.0, **kw: object
) -> EngineState:
    """Every seat taken by an idle adapter: (adapter, last used, loaded at), no seat cap."""
    slots = [
        SlotView(i, a, 0, used, True, PAGES[a], loaded)
        for i, (a, used, loaded) in enumerate(residents)
    ]
    slots.append(SlotView(len(slots), None, 0, 0.0))  # no seat cap: a free seat
    return EngineState(
        step=1,
        now=now,
        slots=tuple(slots),
        host_adapters=tuple(PAGES),
        loading=frozenset(),
        memory_watermark=0.9,
        num_waiting=1,
        num_running=0,
        free_pages=free_pages,
        adapter_pages=PAGES,
        pool_pages=64,
        **kw,  # type: ignore[arg-type]
    )


def request(
    adapter: str = "new", arrival: float = 99.0, rid: str = "r", **kw: object
) -> RequestView:
    return RequestView(rid, adapter, "t0", 4, 0, arrival, 0, **kw)  # type: ignore[arg-type]


def victims(decision: object, view: EngineState) -> list[str | None]:
    assert isinstance(decision, Load)
    return [view.slots[s].adapter_id for s in decision.evict]


def test_every_rival_is_a_policy_the_engine_can_load() -> None:
    for name in RIVAL_POLICIES:
        make_plugin_manager([name])


def test_free_pages_suffice_and_nothing_leaves() -> None:
    view = state([("a", 1.0, 1.0)], free_pages=4)
    assert plan_load(view, request("new"), view.slots[:1]) == Load(1)


def test_a_large_adapter_takes_as_many_victims_as_its_pages_need() -> None:
    view = state([("a", 3.0, 1.0), ("b", 1.0, 2.0), ("c", 2.0, 3.0)], free_pages=1)
    decision = LRUPolicy().lora_guard_adapter_load(request("big"), "warm", view)
    assert victims(decision, view) == ["b", "c"]  # 1 + 4 + 4 >= 8, least recent first


def test_lru_and_fifo_differ_in_whom_they_let_go() -> None:
    view = state([("a", 3.0, 1.0), ("b", 1.0, 2.0)])
    assert victims(LRUPolicy().lora_guard_adapter_load(request(), "warm", view), view) == ["b"]
    assert victims(FIFOPolicy().lora_guard_adapter_load(request(), "warm", view), view) == ["a"]


def test_an_adapter_of_the_running_batch_never_leaves_for_a_rival() -> None:
    view = state([("a", 1.0, 1.0)])
    busy = EngineState(
        **{**_fields(view), "slots": (SlotView(0, "a", 2, 1.0, True, 4, 1.0), view.slots[1])}
    )
    assert isinstance(LRUPolicy().lora_guard_adapter_load(request(), "warm", busy), Defer)


def test_s3_fifo_lets_a_one_hit_newcomer_go_before_a_reused_adapter() -> None:
    policy = S3FIFOPolicy()
    for adapter in ("a", "b"):
        policy.lora_guard_adapter_loaded(adapter)
    policy.lora_guard_adapter_lookup(request("a"), "hot")  # a is used again, b is not
    view = state([("a", 1.0, 1.0), ("b", 2.0, 2.0)])
    assert victims(policy.lora_guard_adapter_load(request(), "warm", view), view) == ["b"]
    assert "a" in policy.main  # moved to the main queue on its way past
    policy.lora_guard_adapter_evicted("b")
    assert "b" in policy.ghost
    policy.lora_guard_adapter_loaded("b")
    assert "b" in policy.main  # remembered by the ghost queue: straight to main


def test_w_tinylfu_keeps_the_frequent_adapter_over_a_newcomer() -> None:
    policy = WTinyLFUPolicy()
    policy.lora_guard_adapter_loaded("a")
    for _ in range(5):
        policy.lora_guard_adapter_lookup(request("a"), "hot")
    view = state([("a", 1.0, 1.0), ("b", 2.0, 2.0)])
    policy.order([], view)  # a, in use, leaves the overfull window for probation
    assert list(policy.probation) == ["a"]
    policy.lora_guard_adapter_loaded("b")  # b: once, in the window
    policy.lora_guard_adapter_lookup(request("b"), "warm")
    assert victims(policy.lora_guard_adapter_load(request(), "warm", view), view) == ["b"]


def test_drain_holds_back_the_adapter_with_the_fewest_tokens_left_for_a_starving_one() -> None:
    policy = DrainPolicy()
    running = [
        request("a", rid="ra", max_new_tokens=100),
        request("b", rid="rb", max_new_tokens=10),
    ]
    view = state([("a", 1.0, 1.0), ("b", 2.0, 2.0)], now=100.0)
    waiting = [
        request("new", arrival=96.0, rid="starving"),  # waited 4 s > 3 s, not resident
        request("b", arrival=99.0, rid="b-long", max_new_tokens=50),
        request("b", arrival=99.0, rid="b-short", max_new_tokens=10),
        request("a", arrival=99.0, rid="a-more"),
    ]
    chosen = policy.lora_guard_batch_form(waiting, running, view)
    assert policy.draining == {"b": "new"}
    assert chosen == ["starving", "b-short", "a-more"]  # b's long request waits for the drain


def test_time_slice_serves_active_adapters_and_rotates_every_slice() -> None:
    policy = TimeSlicePolicy()
    view = state([("a", 1.0, 1.0)], now=100.0)  # the pool holds one adapter: one turn at a time
    waiting = [request("a", arrival=90.0, rid="ra"), request("b", arrival=95.0, rid="rb")]
    assert policy.lora_guard_batch_form(waiting, [], view) == ["ra"]
    later = EngineState(**{**_fields(view), "now": 100.0 + SLICE_S})
    assert policy.lora_guard_batch_form(waiting, [], later) == ["rb"]


def _fields(view: EngineState) -> dict[str, object]:
    return {name: getattr(view, name) for name in EngineState.__dataclass_fields__}
