"""The engine's victim choice is written once (``plugins.eviction``): the residency manager and
the simulator, given the same residents, evict the same adapter."""

from __future__ import annotations

from collections import Counter, OrderedDict

from hypothesis import given, settings
from hypothesis import strategies as st

from lora_guard.engine.kv_cache import BlockManager
from lora_guard.engine.lora.loader import HostCache
from lora_guard.engine.lora.registry import AdapterRegistry
from lora_guard.engine.lora.residency import ResidencyManager
from lora_guard.engine.lora.seats import Resident
from lora_guard.engine.lora.tiers import Sources
from lora_guard.engine.page_pool import AdapterRun, PagePool
from lora_guard.plugins.eviction import ResidentView, eviction_order, kv_order, may_leave
from lora_guard.simulate.fleet import Events, Fleet, Replica, Seat
from lora_guard.simulate_costs import Costs

QUANTUM_S = 1.0
NOW = 100.0

# (loaded seconds ago, used seconds ago, requests that need it)
residents = st.lists(
    st.tuples(st.sampled_from([0.2, 0.9, 1.0, 5.0, 30.0]), st.floats(0, 3), st.integers(0, 2)),
    min_size=1,
    max_size=6,
)


def engine_victim(entries: list[tuple[float, float, int]]) -> str | None:
    """The adapter the residency manager would evict for a seat, every seat taken."""
    no_loader = None  # the choice reads no adapter: neither the pool nor the loader is needed
    pages = PagePool(None, BlockManager(num_blocks=8, block_size=4))  # type: ignore[arg-type]
    residency = ResidencyManager(
        pages,
        Sources(AdapterRegistry(), HostCache(4), no_loader),  # type: ignore[arg-type]
        max_loras=len(entries),
        quantum_s=QUANTUM_S,
    )
    demand: Counter[str] = Counter()
    for seat, (loaded_ago, used_ago, needed) in enumerate(entries):
        adapter_id = f"a{seat}"
        residency.seats[seat] = Resident(
            adapter_id,
            "hash",
            seat,
            run=AdapterRun(0, None, []),  # type: ignore[arg-type]
            loaded_at=NOW - loaded_ago,
            last_used=NOW - min(used_ago, loaded_ago),
        )
        demand[adapter_id] = needed
    residency.begin_step(demand, Counter())
    seat = residency.choose_seat(NOW)
    return None if seat is None else f"a{seat}"


def simulator_victim(entries: list[tuple[float, float, int]]) -> str | None:
    """The adapter the simulator's replica would evict for a seat, every seat taken."""
    replica = Replica("r", len(entries), 8, Costs(), QUANTUM_S)
    replica.resident = OrderedDict(
        (f"a{i}", Seat(NOW - loaded_ago, NOW - min(used_ago, loaded_ago)))
        for i, (loaded_ago, used_ago, _) in enumerate(entries)
    )
    demand = {f"a{i}" for i, (_, _, needed) in enumerate(entries) if needed}
    before = set(replica.resident)
    if not Fleet([replica], Events())._evict(replica, demand, NOW):
        return None
    (gone,) = before - set(replica.resident)
    return gone


@settings(max_examples=200, deadline=None, print_blob=True)
@given(residents)
def test_engine_and_simulator_evict_the_same_adapter(
    entries: list[tuple[float, float, int]],
) -> None:
    assert engine_victim(entries) == simulator_victim(entries)


def test_an_idle_adapter_leaves_before_a_needed_one_and_the_quantum_holds_a_fresh_one() -> None:
    fresh = ResidentView("fresh", last_used=99.0, loaded_at=99.5, needed=True)
    old_needed = ResidentView("old-needed", last_used=90.0, loaded_at=50.0, needed=True)
    idle = ResidentView("idle", last_used=99.9, loaded_at=50.0)
    held = ResidentView("held", last_used=10.0, loaded_at=10.0, held=True)
    views = [fresh, old_needed, idle, held]
    assert not may_leave(fresh, NOW, QUANTUM_S) and not may_leave(held, NOW, QUANTUM_S)
    assert eviction_order(views, NOW, QUANTUM_S) == ["idle", "old-needed"]
    # KV in use outranks the quantum and the requests: least recently used first, held stay.
    assert kv_order(views) == ["old-needed", "fresh", "idle"]
