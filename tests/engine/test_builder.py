"""The builder: each part goes to its owner, and no part calls back into the engine."""

from __future__ import annotations

from pathlib import Path

import pytest

from lora_guard import LLM, SamplingParams
from lora_guard.demo.adapters import make_adapters
from lora_guard.engine import RequestError, UnknownAdapterError
from lora_guard.engine.llm_engine import LLMEngine


@pytest.fixture(scope="module")
def adapter_dir(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("builder-adapters")
    make_adapters(tiny_model, out, n=2, ranks=(4,), strength=0.5, prefix="b")
    return out


def _parts(engine: LLMEngine) -> list[object]:
    scheduler, runner = engine.scheduler, engine.runner
    return [scheduler, scheduler.blocks, scheduler.adapters, runner, runner.pool]


def _refers_to_engine(value: object, engine: LLMEngine) -> bool:
    return value is engine or getattr(value, "__self__", None) is engine


@pytest.mark.parametrize("policies", [None, "on-demand"])
def test_no_part_holds_the_engine_or_its_methods(
    tiny_model: Path, adapter_dir: Path, policies: str | None
) -> None:
    llm = LLM(tiny_model, adapter_dir=adapter_dir, kv_cache_memory="4MiB", policies=policies)
    engine = llm.engine
    try:
        for part in _parts(engine):
            for name, value in vars(part).items():
                assert not _refers_to_engine(value, engine), f"{type(part).__name__}.{name}"
        # the engine reaches its parts through their owners
        assert engine.blocks is engine.scheduler.blocks
        assert engine.adapters is engine.scheduler.adapters
        assert engine.runner.kv_cache is engine.runner.pool.kv
        if policies == "on-demand":  # the merge into the base weights is the runner's
            assert getattr(engine.adapters.merge, "__self__", None) is engine.runner
        outs = llm.generate(
            ["hello there", "hello"], SamplingParams(max_new_tokens=3), adapter_ids=["b-00", None]
        )
        assert [len(o.token_ids) for o in outs] == [3, 3]
        engine.check_no_leaks()
    finally:
        engine.shutdown()


def test_unknown_adapter_is_refused_at_add_request_with_its_own_error(
    tiny_model: Path, adapter_dir: Path
) -> None:
    llm = LLM(tiny_model, adapter_dir=adapter_dir, kv_cache_memory="4MiB")
    try:
        with pytest.raises(UnknownAdapterError, match="adapter 'nope' is not known") as raised:
            llm.engine.add_request("r1", "hello", adapter_id="nope")
        assert isinstance(raised.value, RequestError)
        assert not llm.engine.has_unfinished_requests()
        with pytest.raises(RequestError) as other:
            llm.engine.add_request("r2", [], adapter_id="b-01")
        assert not isinstance(other.value, UnknownAdapterError)
        llm.engine.check_no_leaks()
    finally:
        llm.engine.shutdown()
