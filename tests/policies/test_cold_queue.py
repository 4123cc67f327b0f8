"""The cold-load budget: loads into free memory are free; loads that evict an adapter still in use
wait in an ordered queue, then get a busy answer whose retry-after is true."""

from __future__ import annotations

import time
from pathlib import Path

from lora_guard import LLM, SamplingParams
from lora_guard.demo.testing import AdapterFactory
from lora_guard.engine.outputs import RequestOutput


def test_over_the_budget_requests_queue_in_order_then_get_a_true_retry_after(
    tiny_model: Path, tiny_adapters: AdapterFactory
) -> None:
    adapters = tiny_adapters(n=6, prefix="q")
    # Two seats, one thrashing load a minute, a queue of 0.3 s: of six long requests on six
    # adapters, two load into free seats, one evicts an adapter still in use (the budget), and
    # the three others wait in the queue, then are told to come back when the window has room.
    # The budget alone, first come first served (hot-set would admit no more adapters than the
    # seats hold, and no load would evict an adapter in use).
    queue_s = 0.3
    llm = LLM(
        tiny_model,
        adapters=adapters,
        max_loras=2,
        cache_memory="4MiB",
        residency_quantum_ms=0,
        policies="cold-budget,kv-namespace",
        settings={"cold_loads_per_minute": 1, "cold_queue_timeout": queue_s},
    )
    engine = llm.engine
    engine.scheduler.reject_when_busy = True  # as a server's engine: busy is a 429
    params = SamplingParams(max_new_tokens=400, ignore_eos=True)
    added = time.monotonic()
    for i, name in enumerate(sorted(adapters)):
        engine.add_request(f"r{i}", [5, 6, 7, 10 + i], params, name)
    finished: dict[str, tuple[RequestOutput, float]] = {}
    while engine.has_unfinished_requests():
        outputs = engine.step()
        for out in outputs:
            if out.finished:
                finished[out.request_id] = (out, time.monotonic() - added)
        if not outputs:
            time.sleep(0.001)
    rejected = {rid: (out, at) for rid, (out, at) in finished.items() if out.error is not None}
    served = {rid for rid, (out, _) in finished.items() if out.finish_reason == "length"}
    assert len(served) >= 2 and len(rejected) >= 1 and len(served) + len(rejected) == 6
    for out, at in rejected.values():
        assert at >= queue_s  # it waited in the queue first
        assert out.retry_after is not None and 0 < out.retry_after <= 60
        assert "cold-load budget" in (out.error or "")
    # The budget's one load is in its window until a minute after it: the retry-afters say so.
    assert max(out.retry_after or 0 for out, _ in rejected.values()) > 55
    engine.check_no_leaks()


def test_retry_after_is_when_the_window_has_room_for_each_place_in_the_queue() -> None:
    """Load k (the window's loads, then the queue's) goes a window after load k - per_minute;
    checked against that rule computed forward, for windows fuller and emptier than the budget
    and queues longer than several windows (an emptier window once raised IndexError)."""
    import random

    from lora_guard.policies.cold_budget import MIN_RETRY_AFTER_S, WINDOW_S, ColdLoadBudget

    rng = random.Random(0)
    policy = ColdLoadBudget()
    now = 1000.0
    for _ in range(300):
        policy.per_minute = rng.randint(1, 8)
        loads = sorted(now - rng.uniform(0, WINDOW_S) for _ in range(rng.randint(0, 10)))
        times = list(loads)
        for place in range(25):
            k = len(times)
            times.append(times[k - policy.per_minute] + WINDOW_S if k >= policy.per_minute else now)
            expected = 0.0 if times[-1] <= now else max(times[-1] - now, MIN_RETRY_AFTER_S)
            assert policy.retry_after(loads, now, place) == expected
