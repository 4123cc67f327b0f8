"""The engine's greedy tokens equal transformers + PEFT's, token for token, in float32."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from lora_guard import LLM, SamplingParams
from lora_guard.demo.adapters import make_adapters
from lora_guard.demo.testing import reference_greedy

NEW_TOKENS = 10


@pytest.fixture(scope="module")
def adapters(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Five adapters: ranks 4 and 8, attention only or with MLP, rsLoRA, and one with
    per-module rank and alpha patterns."""
    out = tmp_path_factory.mktemp("oracle-adapters")
    folders = make_adapters(tiny_model, out, n=4, ranks=(4, 8), strength=0.5, prefix="a")
    made = {f.name: f for f in folders}
    base = AutoModelForCausalLM.from_pretrained(tiny_model)
    config = LoraConfig(
        r=8,
        lora_alpha=16,
        target_modules=["q_proj", "v_proj", "down_proj"],
        rank_pattern={"v_proj": 2},
        alpha_pattern={"down_proj": 4},
        init_lora_weights=False,
    )
    import torch

    torch.manual_seed(5)
    get_peft_model(base, config).save_pretrained(str(out / "patterned"))
    made["patterned"] = out / "patterned"
    return made


def _prompts(llm: LLM) -> list[list[int]]:
    """Prompts that share prefixes within and across adapters (several blocks long)."""
    tok = llm.tokenizer
    system = tok.encode("System: you are a helpful assistant. The capital of France is Paris.")
    return [
        system + tok.encode(" User: hello"),
        system + tok.encode(" User: what is a LoRA adapter?"),
        system + tok.encode(" User: hello"),
        tok.encode("The quick brown fox"),
        system + tok.encode(" Tenants send requests"),
        system,
    ]


def _run(llm: LLM, requests: list[tuple[list[int], str | None]]) -> list[list[int]]:
    outs = llm.generate(
        [p for p, _ in requests],
        SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True),
        [a for _, a in requests],
    )
    assert all(o.finish_reason == "length" for o in outs), [o.error for o in outs]
    return [o.token_ids for o in outs]


def _workload(llm: LLM, adapters: dict[str, Path]) -> list[tuple[list[int], str | None]]:
    ids: list[str | None] = [None, *adapters]
    prompts = _prompts(llm)
    return [(p, ids[(i + j) % len(ids)]) for i, p in enumerate(prompts) for j in range(2)]


@pytest.fixture(scope="module")
def expected(
    tiny_model: Path, adapters: dict[str, Path]
) -> Iterator[dict[tuple[tuple[int, ...], str | None], list[int]]]:
    llm = LLM(tiny_model, adapters=adapters, kv_cache_memory="4MiB")
    workload = _workload(llm, adapters)
    refs = reference_greedy(
        tiny_model, [(p, None if a is None else adapters[a]) for p, a in workload], NEW_TOKENS
    )
    yield {(tuple(p), a): r for (p, a), r in zip(workload, refs, strict=True)}


def _check(llm: LLM, adapters: dict[str, Path], expected: dict) -> None:  # type: ignore[type-arg]
    workload = _workload(llm, adapters)
    got = _run(llm, workload)
    for (prompt, adapter), tokens in zip(workload, got, strict=True):
        assert tokens == expected[tuple(prompt), adapter], f"adapter {adapter}"
    llm.engine.check_no_leaks()


def test_adapters_change_the_output(expected: dict) -> None:  # type: ignore[type-arg]
    by_prompt: dict[tuple[int, ...], set[tuple[int, ...]]] = {}
    for (prompt, _adapter), tokens in expected.items():
        by_prompt.setdefault(prompt, set()).add(tuple(tokens))
    assert any(len(outputs) > 1 for outputs in by_prompt.values())


def test_mixed_batch_with_prefix_caching_matches_peft(
    tiny_model: Path,
    adapters: dict[str, Path],
    expected: dict,  # type: ignore[type-arg]
) -> None:
    llm = LLM(tiny_model, adapters=adapters, kv_cache_memory="4MiB", block_size=4, max_loras=8)
    _check(llm, adapters, expected)
    _check(llm, adapters, expected)  # again, now from the prefix cache
    stats = llm.engine.blocks.stats
    assert stats.hit_tokens > 0 and stats.copies_on_write > 0
    assert stats.conflicts == 0


def test_small_kv_pool_preempts_and_still_matches(
    tiny_model: Path,
    adapters: dict[str, Path],
    expected: dict,  # type: ignore[type-arg]
) -> None:
    # 12 blocks for KV, and 32 more pages: the largest adapter here (rank 8 on every projection)
    # takes 32, so KV and adapters contend for the one pool. The engine's defaults admit first
    # come, first served (hot-set admits only what fits beside the batch's KV at its longest).
    llm = LLM(
        tiny_model,
        adapters=adapters,
        cache_memory=_blocks_bytes(tiny_model, 12 + 32, 4),
        block_size=4,
        policies="kv-namespace",
    )
    # Every adapter read from disk first (the host tier keeps them): the workload's requests are
    # then admitted as fast as the pool allows, not as fast as the loader thread reads, so their
    # KV contends with the adapters however quick the disk is.
    warm = SamplingParams(max_new_tokens=1)
    llm.generate([[5, 6]] * len(adapters), warm, list(adapters))
    _check(llm, adapters, expected)
    assert llm.engine.stats.preemptions > 0


def test_fewer_slots_than_adapters_still_matches(
    tiny_model: Path,
    adapters: dict[str, Path],
    expected: dict,  # type: ignore[type-arg]
) -> None:
    llm = LLM(tiny_model, adapters=adapters, kv_cache_memory="4MiB", max_loras=2, max_cpu_loras=2)
    _check(llm, adapters, expected)
    assert llm.engine.adapters.stats.evictions > 0


def test_chunked_prefill_matches(
    tiny_model: Path,
    adapters: dict[str, Path],
    expected: dict,  # type: ignore[type-arg]
) -> None:
    llm = LLM(
        tiny_model,
        adapters=adapters,
        kv_cache_memory="4MiB",
        block_size=4,
        max_batch_tokens=8,
        max_num_seqs=3,
    )
    _check(llm, adapters, expected)


def _blocks_bytes(model_dir: Path, blocks: int, block_size: int) -> int:
    config = json.loads((model_dir / "config.json").read_text())
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    per_block = 2 * config["num_hidden_layers"] * block_size * config["num_key_value_heads"]
    return blocks * per_block * head_dim * 4
