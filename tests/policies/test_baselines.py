"""The baselines: lru (the engine's defaults), on-demand (merge per switch) and static."""

from __future__ import annotations

from pathlib import Path

import pytest

from lora_guard import LLM, SamplingParams
from lora_guard.demo.adapters import make_adapters
from lora_guard.demo.testing import reference_greedy
from lora_guard.engine import ConfigError, RequestError

PARAMS = SamplingParams(max_new_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def adapters(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("baseline-adapters")
    folders = make_adapters(tiny_model, out, n=3, ranks=(4, 8), strength=0.5, prefix="b")
    return {f.name: f for f in folders}


def _requests(llm: LLM) -> list[tuple[list[int], str | None]]:
    tok = llm.tokenizer
    prompts = [tok.encode("The capital of France is"), tok.encode("Tenants send requests")]
    ids: list[str | None] = [None, "b-00", "b-01", "b-02", None, "b-00"]
    return [(prompts[i % 2], a) for i, a in enumerate(ids)]


@pytest.mark.parametrize("policy", ["lru", "on-demand"])
def test_baseline_outputs_match_peft(
    policy: str, tiny_model: Path, adapters: dict[str, Path]
) -> None:
    llm = LLM(tiny_model, adapters=adapters, kv_cache_memory="4MiB", policies=policy)
    requests = _requests(llm)
    outs = llm.generate([p for p, _ in requests], PARAMS, [a for _, a in requests])
    expected = reference_greedy(
        tiny_model, [(p, None if a is None else adapters[a]) for p, a in requests], 8
    )
    assert [o.token_ids for o in outs] == expected
    llm.engine.check_no_leaks()


def test_on_demand_merges_one_adapter_at_a_time_and_restores_the_base(
    tiny_model: Path, adapters: dict[str, Path]
) -> None:
    llm = LLM(tiny_model, adapters=adapters, kv_cache_memory="4MiB", policies="on-demand")
    requests = _requests(llm)
    llm.generate([p for p, _ in requests], PARAMS, [a for _, a in requests])
    assert llm.engine.adapters.stats.loads >= 3  # every switch merges again
    assert not llm.engine.adapters.seats  # no pool seats: the weights themselves change
    # After all that merging and unmerging, the base model is exactly the base model.
    base = llm.generate(requests[0][0], PARAMS, None)[0]
    assert base.token_ids == reference_greedy(tiny_model, [(requests[0][0], None)], 8)[0]
    assert llm.engine.adapters.merged is None
    llm.engine.check_no_leaks()


def test_static_serves_one_merged_adapter_and_refuses_the_rest(
    tiny_model: Path, adapters: dict[str, Path]
) -> None:
    llm = LLM(
        tiny_model,
        adapters=adapters,
        kv_cache_memory="4MiB",
        policies="static",
        settings={"static_adapter": "b-01"},
    )
    prompt = llm.tokenizer.encode("The capital of France is")
    out = llm.generate(prompt, PARAMS, "b-01")[0]
    assert out.token_ids == reference_greedy(tiny_model, [(prompt, adapters["b-01"])], 8)[0]
    for other in ("b-00", None):
        with pytest.raises(RequestError, match="serves only adapter 'b-01'"):
            llm.generate(prompt, PARAMS, other)
    assert llm.engine.adapters.stats.loads == 1
    llm.engine.check_no_leaks()


def test_static_needs_its_adapter(tiny_model: Path, adapters: dict[str, Path]) -> None:
    with pytest.raises(ConfigError, match="static_adapter"):
        LLM(tiny_model, adapters=adapters, kv_cache_memory="4MiB", policies="static")
