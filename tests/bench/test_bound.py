"""The TTFT p95 bound (``bench/virtual/bound.py``): it binds where memory forces requests to
take turns, and not where it does not."""

from __future__ import annotations

import pytest

from lora_guard.bench.virtual.bound import Job, make_jobs, meeting, shared_prefix, ttft_p95_bound_ms
from lora_guard.simulate_costs import Costs
from lora_guard.workload.stats import percentile
from lora_guard.workload.trace import TraceRequest

RUN_S, PREFILL_S = 2.0, 0.2


def turns(n: int, adapter_pages: int) -> list[Job]:
    """``n`` requests at once, each for its own adapter of ``adapter_pages`` pages."""
    return [
        Job(0.0, f"a{i}", PREFILL_S, RUN_S, adapter_pages + 1, adapter_pages, PREFILL_S)
        for i in range(n)
    ]


def test_requests_that_cannot_share_the_pool_take_turns() -> None:
    """Twenty requests at once, each adapter 60% of a 100-page pool: at most one runs at a time
    (a fraction allowed: 1.67), so the 19th first token comes after many whole runs. One at a
    time, in any order, gives 18 runs and a prefill: the bound lies between."""
    jobs = turns(20, 60)
    assert meeting(20) == 19
    bound = ttft_p95_bound_ms(jobs, 100, slot_s=0.5) / 1000
    one_at_a_time = 18 * RUN_S + PREFILL_S
    assert 8 * RUN_S <= bound <= one_at_a_time


def test_requests_that_fit_together_are_bound_only_by_their_prefill() -> None:
    bound = ttft_p95_bound_ms(turns(20, 4), 100) / 1000
    # twenty prefills of 0.2 s must fit the window: 19 of them take 3.8 s at least
    assert 19 * PREFILL_S - 0.1 <= bound <= 19 * PREFILL_S + 0.1
    spread = [
        Job(10.0 * i, f"a{i}", PREFILL_S, RUN_S, 5, 4, PREFILL_S) for i in range(20)
    ]  # one every 10 s: nothing waits
    assert ttft_p95_bound_ms(spread, 100) / 1000 <= PREFILL_S


def test_a_pool_that_cannot_hold_the_adapters_is_refused() -> None:
    with pytest.raises(ValueError, match="20 of 20 requests need more than the pool's 50 pages"):
        ttft_p95_bound_ms(turns(20, 60), 50)


def test_a_prompt_holds_and_computes_only_what_no_request_of_its_adapter_shares() -> None:
    costs = Costs()
    system = list(range(40))
    tokens = {"r0": [*system, 100, 101], "r1": [*system, 200, 201, 202], "r2": [*system, 300]}
    trace = [
        TraceRequest("r0", 0.0, "t0", "a", "", 4),
        TraceRequest("r1", 1.0, "t0", "a", "", 4),
        TraceRequest("r2", 2.0, "t0", "b", "", 4),  # another adapter: nothing shared
    ]
    jobs = make_jobs(trace, tokens, {"a": 10, "b": 20}, {"a": 1.0, "b": 2.0}, costs, 16)
    assert shared_prefix(tokens["r0"], [tokens["r1"]]) == 40
    # 40 shared tokens are two whole blocks of 16: 42 - 32 computed, 3 - 2 blocks held
    assert jobs[0].pages == 10 + 1 and jobs[2].pages == 20 + 3
    decode = costs.step(1, 1, 0, 1.0)
    assert jobs[0].prefill_s * 1000 == pytest.approx(decode + costs.prefill_per_token_ms * 10)
    assert jobs[0].run_s * 1000 == pytest.approx(jobs[0].prefill_s * 1000 + 3 * decode)
    assert jobs[2].prefill_s * 1000 == pytest.approx(
        costs.step(1, 1, 0, 2.0) + costs.prefill_per_token_ms * 41
    )


def test_a_p95_within_a_ttft_needs_meeting_requests_within_it() -> None:
    """The bound asks ``meeting(n)`` first tokens within the TTFT: with one fewer, the p95
    (interpolated) is beyond it."""
    for n in (1, 2, 3, 20, 999, 1000):
        need = meeting(n)
        fewer = [0.0] * (need - 1) + [1.0] * (n - need + 1)
        assert (percentile(fewer, 95) or 0.0) > 0.0
        assert need == n or percentile([0.0] * n, 95) == 0.0
