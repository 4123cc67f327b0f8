"""The base model's projections in oneDNN's blocked layout (float32 and bfloat16 on the CPU) compute
what the plain layout does, and a merge into them is undone exactly."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lora_guard import LLM, SamplingParams
from lora_guard.demo.testing import AdapterFactory
from lora_guard.engine.linear import Linear, blocked_layout_available
from lora_guard.engine.lora import read_adapter
from lora_guard.engine.model import LlamaModel
from lora_guard.engine.values import ConfigError

CPU = torch.device("cpu")
needs_blocked = pytest.mark.skipif(
    not blocked_layout_available(torch.float32, CPU), reason="this torch has no oneDNN"
)


def test_the_blocked_layout_is_used_for_float32_and_bfloat16_on_the_cpu_only() -> None:
    assert blocked_layout_available(torch.float32, CPU)  # the torch the README installs has it
    assert blocked_layout_available(torch.bfloat16, CPU)
    assert not blocked_layout_available(torch.float16, CPU)
    assert not blocked_layout_available(torch.float32, torch.device("meta"))


@needs_blocked
@pytest.mark.parametrize("rows", [1, 5, 32, 33, 300])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_blocked_and_plain_compute_the_same_projection(
    rows: int, with_bias: bool, dtype: torch.dtype
) -> None:
    torch.manual_seed(rows)
    weight = torch.randn(96, 40).to(dtype)
    bias = torch.randn(96).to(dtype) if with_bias else None
    x = torch.randn(rows, 40).to(dtype)
    wide_bias = None if bias is None else bias.float()
    expected = torch.nn.functional.linear(x.float(), weight.float(), wide_bias)
    # float32 to rounding; bfloat16 to two of its steps (1/256 each) of the largest output
    atol = 1e-4 if dtype == torch.float32 else expected.abs().max().item() / 128
    for blocked in (True, False):
        y = Linear(weight, bias, blocked=blocked)(x)
        assert y.shape == (rows, 96) and y.dtype == dtype
        assert torch.allclose(y.float(), expected, atol=atol), blocked


@needs_blocked
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_blocked_weight_unpacks_to_the_weight_it_was_given(dtype: torch.dtype) -> None:
    weight = torch.randn(64, 48).to(dtype)
    linear = Linear(weight, None, blocked=True)
    assert torch.equal(linear.dense(), weight)
    linear.replace(weight * 2)
    assert torch.equal(linear.dense(), weight * 2)
    assert linear.nbytes >= weight.numel() * weight.element_size()


@needs_blocked
def test_a_merge_into_blocked_weights_changes_the_logits_and_unmerges_exactly(
    tiny_model: Path, tiny_adapters: AdapterFactory
) -> None:
    path = next(iter(tiny_adapters(n=1, prefix="merge", ranks=(4,)).values()))
    blocked = LlamaModel(tiny_model, torch.float32, CPU)
    plain = LlamaModel(tiny_model, torch.float32, CPU, blocked=False)
    assert blocked.blocked and not plain.blocked
    adapter = read_adapter("merge-0", path, blocked.spec, 64)
    before = {
        (i, name): p.dense()
        for i, layer in enumerate(blocked.layers)
        for name, p in layer.projections.items()
    }
    for model in (blocked, plain):
        model.merge_lora(adapter.weights)
    for i, name in before:
        merged_blocked = blocked.layers[i].projections[name].dense()
        merged_plain = plain.layers[i].projections[name].dense()
        assert torch.allclose(merged_blocked, merged_plain, atol=1e-6)
    assert any(
        not torch.equal(blocked.layers[i].projections[n].dense(), w) for (i, n), w in before.items()
    )
    blocked.unmerge_lora()
    for (i, name), weight in before.items():
        assert torch.equal(blocked.layers[i].projections[name].dense(), weight)
    assert blocked.merge_copy_bytes() == 0


@needs_blocked
def test_a_step_reads_the_blocked_head_not_the_embedding_table(tiny_model: Path) -> None:
    blocked = LlamaModel(tiny_model, torch.float32, CPU, rows=False)
    plain = LlamaModel(tiny_model, torch.float32, CPU, blocked=False, rows=False)
    table = blocked.embed.numel() * 4
    assert blocked.spec.tie_word_embeddings
    # The blocked head is a second copy of the tied table; a step reads it, not the table.
    assert blocked.weight_bytes() >= plain.weight_bytes() + table
    assert blocked.step_bytes() == blocked.weight_bytes() - table
    assert plain.step_bytes() == plain.weight_bytes()


@needs_blocked
def test_the_rows_kept_beside_the_blocked_weights_are_held_once_and_read_instead(
    tiny_model: Path,
) -> None:
    both = LlamaModel(tiny_model, torch.float32, CPU)  # the default: blocked, and the rows
    blocked = LlamaModel(tiny_model, torch.float32, CPU, rows=False)
    assert both.blocked and both.rows and not blocked.rows
    projections = [p for layer in both.layers for p in layer.projections.values()]
    rows = sum(p.nbytes - p.read_bytes for p in projections)
    assert rows == sum(p.dense().numel() * 4 for p in projections)
    # The tied head's rows are the embedding table itself: no third copy of it.
    assert both.weight_bytes() == blocked.weight_bytes() + rows
    assert both.step_bytes() == blocked.step_bytes()


@needs_blocked
def test_the_engine_answers_the_same_in_either_layout(
    tiny_model: Path, tiny_adapters: AdapterFactory
) -> None:
    adapters = tiny_adapters(n=3, prefix="layout", ranks=(4, 8))
    names = sorted(adapters)
    prompts = [[5, 6, 7, 8, 9 + i] for i in range(6)]
    ids = [None if i % 4 == 0 else names[i % len(names)] for i in range(6)]
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    outs = {}
    for layout in ("blocked", "plain"):
        llm = LLM(tiny_model, adapters=adapters, cache_memory="4MiB", weight_layout=layout)
        assert llm.engine.model.blocked == (layout == "blocked")
        assert not llm.engine.model.rows  # the row kernel's copy is auto's alone
        outs[layout] = [o.token_ids for o in llm.generate(prompts, params, ids)]
        llm.engine.shutdown()
    assert outs["blocked"] == outs["plain"]


def test_a_blocked_layout_that_cannot_apply_is_a_config_error(tiny_model: Path) -> None:
    with pytest.raises(ConfigError, match="weight_layout=blocked"):
        LLM(tiny_model, cache_memory="4MiB", dtype="float16", weight_layout="blocked")
    fp16 = LLM(tiny_model, cache_memory="4MiB", dtype="float16")  # auto: plain
    assert not fp16.engine.model.blocked
    bf16 = LLM(tiny_model, cache_memory="4MiB", dtype="bfloat16")  # auto: blocked, and the rows
    assert bf16.engine.model.blocked and bf16.engine.model.rows
