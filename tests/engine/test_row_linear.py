"""The row kernel (``row_linear.cpp``) computes a projection of a decode step's few rows as
torch's linear does, within one rounding of the output; a projection keeps its rows beside its
blocked weight by default on the CPU and uses them for those steps only; and the engine answers
with the same greedy tokens either way."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from lora_guard import LLM, SamplingParams
from lora_guard.engine import native
from lora_guard.engine.linear import ROW_KERNEL_ROWS, Linear

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(scope="module")
def row_linear() -> Any:
    assert native.load(), native.error()  # a C++ compiler and ninja are part of the set-up
    return torch.ops.lora_guard.row_linear


def within_one_rounding(got: torch.Tensor, want: torch.Tensor) -> bool:
    """``got`` (float32 or bfloat16) within a rounding of its dtype of the exact ``want``:
    bfloat16 two of its steps of the largest output, float32 its sums' order."""
    scale = want.abs().max().item()
    atol = scale / 128 if got.dtype == torch.bfloat16 else scale * 1e-5
    return torch.allclose(got.double(), want, atol=atol, rtol=0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1728, 576), (576, 1536), (37, 70), (5, 33), (3, 16)])
def test_every_row_count_it_takes_with_and_without_bias(
    row_linear: Any, dtype: torch.dtype, shape: tuple[int, int]
) -> None:
    # (37, 70) and (5, 33): inputs that are not a whole number of vectors, blocks of weight
    # rows cut short, fewer weight rows than threads
    torch.manual_seed(shape[0])
    out, fan_in = shape
    weight = torch.randn(out, fan_in).to(dtype)
    bias = torch.randn(out).to(dtype)
    for rows in range(1, 9):
        x = torch.randn(rows, fan_in).to(dtype)
        exact = x.double() @ weight.double().t()
        got = row_linear(x, weight, None)
        assert got.shape == (rows, out) and got.dtype == dtype
        assert within_one_rounding(got, exact), (rows, (got.double() - exact).abs().max())
        with_bias = row_linear(x, weight, bias)
        assert within_one_rounding(with_bias, exact + bias.double()), rows


def test_bfloat16_agrees_with_torchs_linear_on_the_demos_shapes(row_linear: Any) -> None:
    torch.manual_seed(1)
    for out, fan_in in [(1728, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)]:
        weight = (torch.randn(out, fan_in) * 0.05).bfloat16()
        x = torch.randn(1, fan_in).bfloat16()
        ours, torchs = row_linear(x, weight, None).float(), F.linear(x, weight).float()
        # each rounds an exact-enough float32 sum once: a step of bfloat16 apart at most
        assert torch.allclose(ours, torchs, rtol=2**-7, atol=1e-3), (out, fan_in)


def test_bad_input_is_a_clear_error(row_linear: Any) -> None:
    weight = torch.randn(8, 16)
    with pytest.raises(RuntimeError, match="takes 1 to 8"):
        row_linear(torch.randn(9, 16), weight, None)
    with pytest.raises(RuntimeError, match="takes 1 to 8"):
        row_linear(torch.randn(0, 16), weight, None)
    with pytest.raises(RuntimeError, match="does not match the weight"):
        row_linear(torch.randn(1, 15), weight, None)
    with pytest.raises(RuntimeError, match="x must be Float"):
        row_linear(torch.randn(1, 16).bfloat16(), weight, None)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        row_linear(torch.randn(1, 16).half(), weight.half(), None)
    with pytest.raises(RuntimeError, match="contiguous"):
        row_linear(torch.randn(1, 16), torch.randn(16, 8).t(), None)
    with pytest.raises(RuntimeError, match="the bias must be"):
        row_linear(torch.randn(1, 16), weight, torch.randn(7))


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_projection_uses_its_rows_for_a_few_rows_and_keeps_them_through_a_merge(
    row_linear: Any, dtype: torch.dtype
) -> None:
    torch.manual_seed(2)
    weight, bias = torch.randn(96, 64).to(dtype), torch.randn(96).to(dtype)
    both = Linear(weight, bias, blocked=True, rows=True)
    blocked = Linear(weight, bias, blocked=True)
    assert both.row_limit == ROW_KERNEL_ROWS[dtype] and blocked.row_limit == 0
    few, many = torch.randn(both.row_limit, 64).to(dtype), torch.randn(32, 64).to(dtype)
    assert torch.equal(both(few), row_linear(few, weight, bias))
    assert torch.equal(both(many), blocked(many))  # a larger batch takes the blocked weight
    assert torch.equal(both.dense(), weight)
    both.replace(weight * 2)  # what a merge does
    assert torch.equal(both.dense(), weight * 2)
    assert torch.equal(both(few), row_linear(few, weight * 2, bias))
    assert torch.equal(both(many), Linear(weight * 2, bias, blocked=True)(many))


def test_the_engine_keeps_rows_by_default_and_answers_as_without_them(tiny_model: Path) -> None:
    llm = LLM(tiny_model, kv_cache_memory="4MiB")  # float32 on the CPU
    prompts = [[5, 6, 7, 8, 9 + i] for i in range(3)]
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    try:
        model = llm.engine.model
        assert model.rows
        linears = [p for layer in model.layers for p in layer.projections.values()]
        assert isinstance(model.lm_head, Linear)
        linears.append(model.lm_head)
        assert all(p.row_limit == ROW_KERNEL_ROWS[torch.float32] for p in linears)
        alone = [llm.generate([p], params)[0] for p in prompts]  # one row a decode step
        together = llm.generate(prompts, params)  # three rows
        for p in linears:
            p.row_limit = 0  # oneDNN's blocked kernel alone
        blocked = llm.generate(prompts, params)
        for outs in (alone, together):
            assert [o.token_ids for o in outs] == [o.token_ids for o in blocked]
            for a, b in zip(outs, blocked, strict=True):
                assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
        llm.engine.check_no_leaks()
    finally:
        llm.engine.shutdown()
