"""24 adapters with Zipf popularity on 8 seats: hot-set against LRU and the offline optimum."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from lora_guard import LLM, SamplingParams
from lora_guard.demo.adapters import make_adapters
from lora_guard.plugins import hookimpl
from lora_guard.plugins.state import RequestView
from lora_guard.workload.bounds import (
    belady_hit_rate,
    independent_optimum_hit_rate,
    known_popularity_hit_rate,
    learned_frequency_hit_rate,
    zipf_trace,
)

NUM_ADAPTERS, SLOTS, REQUESTS, PER_STEP = 24, 8, 480, 2


class LookupRecorder:
    def __init__(self) -> None:
        self.results: list[str] = []

    @hookimpl
    def lora_guard_adapter_lookup(self, request: RequestView, result: str) -> None:
        self.results.append(result)


@pytest.fixture(scope="module")
def adapters(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("zipf-adapters")
    folders = make_adapters(tiny_model, out, n=NUM_ADAPTERS, ranks=(2, 4), prefix="z")
    return {f.name: f for f in folders}


def device_hit_rate(tiny_model: Path, adapters: dict[str, Path], policies: str) -> float:
    names = sorted(adapters)
    llm = LLM(
        tiny_model,
        adapters=adapters,
        max_loras=SLOTS,
        max_cpu_loras=NUM_ADAPTERS,
        kv_cache_memory="8MiB",
        policies=policies,
    )
    recorder = LookupRecorder()
    llm.engine.hooks.pm.register(recorder)
    engine = llm.engine
    params = SamplingParams(max_new_tokens=2, ignore_eos=True)
    trace = zipf_trace(NUM_ADAPTERS, REQUESTS, exponent=1.0, seed=0)
    pending = list(enumerate(trace))
    while pending or engine.has_unfinished_requests():
        for i, adapter in pending[:PER_STEP]:
            engine.add_request(f"z{i}", [5, 6, 7, i % 50 + 10], params, names[adapter])
        pending = pending[PER_STEP:]
        outputs = engine.step()
        assert all(o.error is None for o in outputs), [o.error for o in outputs if o.error]
        # Reads from disk land at the next step, whatever the machine's speed: the same run
        # every time.
        while not all(f.done() for f in engine.adapters.loader.pending.values()):
            time.sleep(0.0005)
    engine.check_no_leaks()
    assert len(recorder.results) == REQUESTS
    return recorder.results.count("hot") / REQUESTS


def test_hot_set_beats_lru_and_nears_the_offline_optimum(
    tiny_model: Path, adapters: dict[str, Path]
) -> None:
    trace = zipf_trace(NUM_ADAPTERS, REQUESTS, exponent=1.0, seed=0)
    optimum = belady_hit_rate(trace, SLOTS)
    known = known_popularity_hit_rate(trace, SLOTS)
    weights = {i: 1 / (i + 1) for i in range(NUM_ADAPTERS)}
    online = independent_optimum_hit_rate(trace, SLOTS, weights)
    learned = learned_frequency_hit_rate(trace, SLOTS)
    lru = device_hit_rate(tiny_model, adapters, "lru")
    hot_set = device_hit_rate(tiny_model, adapters, "hot-set,kv-namespace")
    print(
        f"hit rate: hot-set {hot_set:.3f}, lru {lru:.3f}, Belady {optimum:.3f}, "
        f"known popularity {known:.3f}, online optimum (A0) {online:.3f}, learned frequency "
        f"{learned:.3f}"
    )
    # Each request is looked up once, when the scheduler first offers it, so Belady over the
    # arrival order bounds both (up to the small reordering batch form does). The trace's
    # requests are drawn independently, so the best online policy is A0 with the true
    # popularities: 0.677 here, as for a policy that knew every adapter's share of this trace.
    # A policy that learns the popularities as it goes can only approach it: counting every
    # request from the start (no window, one request at a time) hits 0.660.
    assert max(hot_set, lru) <= optimum + 0.02
    assert known == pytest.approx(0.677, abs=0.001)
    assert online == pytest.approx(0.677, abs=0.001)
    # counting every request from the start, one at a time, the best a learner does here
    assert learned == pytest.approx(0.660, abs=0.001)
    assert hot_set >= lru + 0.06  # measured 0.640 against 0.546
    assert hot_set >= 0.85 * optimum  # 0.862 of 0.742


def test_belady_on_a_small_trace() -> None:
    trace = [0, 1, 2, 0, 3, 0, 1, 2, 3, 0]
    # Two slots: evict 1 at step 2, 2 at step 4, 0 at step 6, 1 at step 7; hits at 3, 5, 8.
    assert belady_hit_rate(trace, 2) == 0.3
    assert belady_hit_rate(trace, 4) == 0.6  # only the four first uses miss
