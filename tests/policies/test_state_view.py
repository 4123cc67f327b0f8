"""What hooks see: the read-only state view carries slots, heat, pins, cold loads and the queue."""

from __future__ import annotations

from pathlib import Path

import pytest

from lora_guard import LLM, SamplingParams
from lora_guard.demo.testing import AdapterFactory
from lora_guard.plugins import hookimpl
from lora_guard.plugins.state import EngineState


class LastState:
    def __init__(self) -> None:
        self.states: list[EngineState] = []

    @hookimpl
    def lora_guard_step_finished(self, state: EngineState) -> None:
        self.states.append(state)


def test_state_view_reports_heat_cold_loads_and_slots(
    tiny_model: Path, tiny_adapters: AdapterFactory
) -> None:
    adapters = tiny_adapters(n=3, prefix="s")
    llm = LLM(tiny_model, adapters=adapters, kv_cache_memory="4MiB", max_loras=3, policies="lru")
    llm.engine.adapters.usage.pin("s-01")  # what the admin route calls
    seen = LastState()
    llm.engine.hooks.pm.register(seen)
    ids = ["s-00", "s-00", "s-01", None, "s-00"]
    llm.generate(["hello there"] * len(ids), SamplingParams(max_new_tokens=3), ids)

    last = seen.states[-1]
    assert dict(last.heat) == {"s-00": 3, "s-01": 1}
    assert dict(last.tenant_heat) == {("default", "s-00"): 3, ("default", "s-01"): 1}
    assert last.pinned == {"s-01"}
    assert last.cold_loads_in_window == 2  # s-00 and s-01, each read once
    assert last.evicting_loads == ()  # both went into free seats
    assert len(last.slots) == 3 and {v.adapter_id for v in last.slots} == {"s-00", "s-01", None}
    assert [v.evictable for v in last.slots if v.adapter_id == "s-01"] == [False]
    assert last.num_running == last.num_waiting == 0 and last.kv_share == 0
    assert last.memory_watermark == last.pool_bytes["adapter"] / sum(last.pool_bytes.values())
    assert any(s.num_running > 0 and s.memory_watermark > 0 for s in seen.states)
    with pytest.raises(TypeError):
        last.heat["s-02"] = 1  # type: ignore[index]
    llm.engine.check_no_leaks()
