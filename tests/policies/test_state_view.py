"""What hooks see: the read-only state view carries slots, heat, cold loads and the queue."""

from __future__ import annotations

from pathlib import Path

import pytest

from lora_guard import LLM, SamplingParams
from lora_guard.adapter_maker import make_adapters
from lora_guard.plugins import hookimpl
from lora_guard.plugins.state import EngineState


class LastState:
    def __init__(self) -> None:
        self.states: list[EngineState] = []

    @hookimpl
    def lora_guard_step_finished(self, state: EngineState) -> None:
        self.states.append(state)


@pytest.fixture(scope="module")
def adapters(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("state-adapters")
    return {f.name: f for f in make_adapters(tiny_model, out, n=3, ranks=(4,), prefix="s")}


def test_state_view_reports_heat_cold_loads_and_slots(
    tiny_model: Path, adapters: dict[str, Path]
) -> None:
    llm = LLM(tiny_model, adapters=adapters, kv_cache_memory="4MiB", max_loras=2, policies="lru")
    seen = LastState()
    llm.engine.hooks.pm.register(seen)
    ids = ["s-00", "s-00", "s-01", None, "s-00"]
    llm.generate(["hello there"] * len(ids), SamplingParams(max_new_tokens=3), ids)

    last = seen.states[-1]
    assert dict(last.heat) == {"s-00": 3, "s-01": 1}
    assert last.cold_loads_in_window == 2  # s-00 and s-01, each read once
    assert len(last.slots) == 2 and {v.adapter_id for v in last.slots} == {"s-00", "s-01"}
    assert last.num_running == last.num_waiting == 0 and last.kv_share == 0
    assert last.memory_watermark == last.pool_bytes["adapter"] / sum(last.pool_bytes.values())
    assert any(s.num_running > 0 and s.memory_watermark > 0 for s in seen.states)
    with pytest.raises(TypeError):
        last.heat["s-02"] = 1  # type: ignore[index]
    llm.engine.check_no_leaks()
