"""The base model's projections in oneDNN's blocked layout compute what the plain layout does, and
a merge into them is undone exactly."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lora_guard.engine.linear import Linear, blocked_layout_available
from lora_guard.engine.lora import read_adapter
from lora_guard.engine.model import LlamaModel
from lora_guard.testing import AdapterFactory

CPU = torch.device("cpu")
needs_blocked = pytest.mark.skipif(
    not blocked_layout_available(torch.float32, CPU), reason="this torch has no oneDNN"
)


def test_the_blocked_layout_is_used_for_float32_on_the_cpu_only() -> None:
    assert blocked_layout_available(torch.float32, CPU)  # the torch the README installs has it
    assert not blocked_layout_available(torch.bfloat16, CPU)
    assert not blocked_layout_available(torch.float32, torch.device("meta"))


@needs_blocked
@pytest.mark.parametrize("rows", [1, 5, 32, 33, 300])
@pytest.mark.parametrize("with_bias", [False, True])
def test_blocked_and_plain_compute_the_same_projection(rows: int, with_bias: bool) -> None:
    torch.manual_seed(rows)
    weight, bias = torch.randn(96, 40), torch.randn(96) if with_bias else None
    x = torch.randn(rows, 40)
    expected = torch.nn.functional.linear(x, weight, bias)
    for blocked in (True, False):
        y = Linear(weight, bias, blocked=blocked)(x)
        assert y.shape == (rows, 96)
        assert torch.allclose(y, expected, atol=1e-4), blocked


@needs_blocked
def test_a_blocked_weight_unpacks_to_the_weight_it_was_given() -> None:
    weight = torch.randn(64, 48)
    linear = Linear(weight, None, blocked=True)
    assert torch.equal(linear.dense(), weight)
    linear.replace(weight * 2)
    assert torch.equal(linear.dense(), weight * 2)
    assert linear.nbytes >= weight.numel() * 4


@needs_blocked
def test_a_merge_into_blocked_weights_changes_the_logits_and_unmerges_exactly(
    tiny_model: Path, tiny_adapters: AdapterFactory
) -> None:
    path = next(iter(tiny_adapters(n=1, prefix="merge", ranks=(4,)).values()))
    blocked = LlamaModel(tiny_model, torch.float32, CPU)
    plain = LlamaModel(tiny_model, torch.float32, CPU, blocked=False)
    assert blocked.blocked and not plain.blocked
    adapter = read_adapter("merge-0", path, blocked.spec, 64)
    before = {(i, name): p.dense() for i, layer in enumerate(blocked.layers)
              for name, p in layer.projections.items()}  # fmt: skip
    for model in (blocked, plain):
        model.merge_lora(adapter.weights)
    for i, name in before:
        merged_blocked = blocked.layers[i].projections[name].dense()
        merged_plain = plain.layers[i].projections[name].dense()
        assert torch.allclose(merged_blocked, merged_plain, atol=1e-6)
    assert any(not torch.equal(blocked.layers[i].projections[n].dense(), w)
               for (i, n), w in before.items())  # fmt: skip
    blocked.unmerge_lora()
    for (i, name), weight in before.items():
        assert torch.equal(blocked.layers[i].projections[name].dense(), weight)
    assert blocked.merge_copy_bytes() == 0


@needs_blocked
def test_a_step_reads_the_blocked_head_not_the_embedding_table(tiny_model: Path) -> None:
    blocked = LlamaModel(tiny_model, torch.float32, CPU)
    plain = LlamaModel(tiny_model, torch.float32, CPU, blocked=False)
    table = blocked.embed.numel() * 4
    assert blocked.spec.tie_word_embeddings
    # The blocked head is a second copy of the tied table; a step reads it, not the table.
    assert blocked.weight_bytes() >= plain.weight_bytes() + table
    assert blocked.step_bytes() == blocked.weight_bytes() - table
    assert plain.step_bytes() == plain.weight_bytes()
