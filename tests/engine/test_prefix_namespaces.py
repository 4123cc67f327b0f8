"""Prefix-cache hits stay inside one (base model, adapter, adapter weights) namespace."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from lora_guard import LLM, SamplingParams
from lora_guard.demo.adapters import make_adapters
from lora_guard.demo.testing import reference_greedy

PARAMS = SamplingParams(max_new_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def adapter_pair(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    out = tmp_path_factory.mktemp("ns-adapters")
    return make_adapters(tiny_model, out, n=2, ranks=(8,), strength=0.5, prefix="ns")


def _prompt(llm: LLM) -> list[int]:
    return llm.tokenizer.encode("System: you are a helpful assistant. User: hello there")


def test_hits_within_an_adapter_never_across(tiny_model: Path, adapter_pair: list[Path]) -> None:
    a, b = (p.name for p in adapter_pair)
    llm = LLM(
        tiny_model, adapters={p.name: p for p in adapter_pair}, block_size=4, kv_cache_memory="4MiB"
    )
    prompt = _prompt(llm)
    full_blocks = len(prompt) // 4 * 4

    first = llm.generate(prompt, PARAMS, a)[0]
    again = llm.generate(prompt, PARAMS, a)[0]
    other = llm.generate(prompt, PARAMS, b)[0]
    base = llm.generate(prompt, PARAMS, None)[0]
    base_again = llm.generate(prompt, PARAMS, None)[0]

    assert first.num_cached_tokens == 0
    assert again.num_cached_tokens >= full_blocks - 4 > 0
    assert again.token_ids == first.token_ids
    assert other.num_cached_tokens == 0, "adapter b reused adapter a's KV"
    assert base.num_cached_tokens == 0, "the base model reused an adapter's KV"
    assert base_again.num_cached_tokens > 0
    assert llm.engine.blocks.stats.conflicts == 0
    llm.engine.check_no_leaks()


def test_reloaded_weights_under_the_same_id_get_no_stale_hits(
    tiny_model: Path, adapter_pair: list[Path], tmp_path: Path
) -> None:
    folder = tmp_path / "tenant-x"
    shutil.copytree(adapter_pair[0], folder)
    llm = LLM(tiny_model, adapters={"tenant-x": folder}, block_size=4, kv_cache_memory="4MiB")
    prompt = _prompt(llm)
    before = llm.generate(prompt, PARAMS, "tenant-x")[0]
    assert llm.generate(prompt, PARAMS, "tenant-x")[0].num_cached_tokens > 0

    # The tenant ships new weights under the same adapter id.
    shutil.rmtree(folder)
    shutil.copytree(adapter_pair[1], folder)
    llm.add_adapter("tenant-x", folder)
    after = llm.generate(prompt, PARAMS, "tenant-x")[0]

    assert after.num_cached_tokens == 0, "KV computed under the old weights was reused"
    assert after.token_ids == reference_greedy(tiny_model, [(prompt, folder)], 6)[0]
    assert after.token_ids != before.token_ids
    llm.engine.check_no_leaks()
