"""The engine keeps time on the clock it is given: arrivals, first tokens, ends, the state view's
``now`` and the heat window all read it, and the process's ``time.monotonic`` is left alone."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from lora_guard.demo.testing import AdapterFactory
from lora_guard.engine import LLM, SamplingParams
from lora_guard.plugins import hookimpl
from lora_guard.plugins.state import EngineState, RequestView


class FakeClock:
    def __init__(self) -> None:
        self.now = 5000.0

    def __call__(self) -> float:
        return self.now


class Seen:
    def __init__(self) -> None:
        self.states: list[EngineState] = []
        self.finished: dict[str, RequestView] = {}

    @hookimpl
    def lora_guard_step_finished(self, state: EngineState) -> None:
        self.states.append(state)

    @hookimpl
    def lora_guard_request_finished(self, request: RequestView) -> None:
        self.finished[request.request_id] = request


def run(engine: Any, clock: FakeClock, tick_s: float = 0.25) -> None:
    """Steps until every request ended, the clock ``tick_s`` later after each."""
    while engine.has_unfinished_requests():
        engine.step()
        clock.now += tick_s


@pytest.fixture(scope="module")
def adapters(tiny_adapters: AdapterFactory) -> dict[str, Path]:
    return tiny_adapters(1, "clock")


def test_an_engine_keeps_time_on_the_clock_it_is_given(
    tiny_model: Path, adapters: dict[str, Path]
) -> None:
    clock, seen = FakeClock(), Seen()
    (adapter_id,) = adapters
    llm = LLM(
        tiny_model, adapters=dict(adapters), cache_memory="16MiB", policies="lru", clock=clock
    )
    engine = llm.engine
    engine.hooks.pm.register(seen, name="seen")
    params = SamplingParams(max_new_tokens=2, ignore_eos=True)
    engine.add_request("a", [5, 6, 7], params)
    clock.now += 1.5
    run(engine, clock)
    request = seen.finished["a"]
    assert (request.arrival_time, request.first_token_time) == (5000.0, 5001.5)
    assert request.finished_time == 5001.75  # the second step, a quarter second later
    assert seen.states[0].now == 5001.5

    engine.add_request("b", [5, 6, 7], params, adapter_id)
    run(engine, clock, tick_s=0.0)  # however many steps its adapter's read takes
    assert seen.states[-1].heat == {adapter_id: 1}
    clock.now += 61.0  # past the heat window, on this clock only
    engine.add_request("c", [5, 6, 7], params)
    run(engine, clock)
    assert seen.states[-1].now == seen.finished["c"].finished_time
    assert dict(seen.states[-1].heat) == {}
    engine.check_no_leaks()
    engine.shutdown()
