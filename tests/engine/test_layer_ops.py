"""The compiled layer operations (``layer_ops.cpp``) compute what the torch operations they
replace compute: bit for bit in bfloat16 where no float32 sum is involved, within one bfloat16
rounding where one is; and the engine runs them by default on the CPU, with the same greedy
tokens as the torch forward."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from lora_guard import LLM, SamplingParams
from lora_guard.demo.adapters import make_adapters
from lora_guard.engine import native
from lora_guard.engine.model import rms_norm, rotate

DTYPES = [torch.float32, torch.bfloat16]
HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64
EPS = 1e-5


@pytest.fixture(scope="module")
def ops() -> Any:
    assert native.load(), native.error()  # a C++ compiler and ninja are part of the set-up
    return torch.ops.lora_guard


def close(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Equal within one rounding of got's dtype (float32: a few ulps of its sums' order)."""
    rtol = 2**-8 if got.dtype == torch.bfloat16 else 1e-5
    return torch.allclose(got.float(), want.float(), rtol=rtol, atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
def test_norms_silu_and_the_residual_add(ops: Any, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    x, delta = (torch.randn(7, 576) * 3).to(dtype), torch.randn(7, 576).to(dtype)
    weight = torch.randn(576).to(dtype)
    assert close(ops.rms_norm(x, weight, EPS), rms_norm(x, weight, EPS))
    added = x.clone()
    normed = ops.add_rms_norm(added, delta, weight, EPS)
    assert torch.equal(added, x + delta)  # the residual, in place, rounded as torch rounds
    assert close(normed, rms_norm(x + delta, weight, EPS))
    gate_up = (torch.randn(5, 2 * 1536) * 4).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    got = ops.silu_mul(gate_up)
    if dtype == torch.bfloat16:
        assert torch.equal(got, F.silu(gate) * up)
    assert close(got, F.silu(gate) * up)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_rotates_queries_and_keys_and_writes_the_cache(ops: Any, dtype: torch.dtype) -> None:
    torch.manual_seed(1)
    tokens = 6
    qkv = torch.randn(tokens, (HEADS + 2 * KV_HEADS) * HEAD_DIM).to(dtype)
    freqs = torch.arange(3, 3 + tokens).float()[:, None] / 10000 ** (
        torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM
    )
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]
    half = HEAD_DIM // 2
    signed_sin = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
    k_cache = torch.zeros(40, KV_HEADS, HEAD_DIM, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.tensor([17, 3, 39, 0, 22, 8])
    q = ops.rope_cache(
        qkv, cos.contiguous(), signed_sin.contiguous(), k_cache, v_cache, slots, HEADS, KV_HEADS
    )
    qk_size = (HEADS + KV_HEADS) * HEAD_DIM
    qk = rotate(qkv[:, :qk_size].view(tokens, -1, HEAD_DIM), cos, signed_sin)
    assert close(q, qk[:, :HEADS]) and close(k_cache[slots], qk[:, HEADS:])
    if dtype == torch.bfloat16:  # each product and the sum rounded where torch rounds them
        assert torch.equal(q, qk[:, :HEADS]) and torch.equal(k_cache[slots], qk[:, HEADS:])
    assert torch.equal(v_cache[slots], qkv[:, qk_size:].view(tokens, KV_HEADS, HEAD_DIM))
    untouched = torch.ones(40, dtype=torch.bool)
    untouched[slots] = False
    assert not k_cache[untouched].any() and not v_cache[untouched].any()


# (query heads, KV heads, head size): the vector path's sizes, and a plain loop's (a group of
# ten, heads of 48)
ATTENTION_SHAPES = [(9, 3, 64), (8, 2, 128), (10, 1, 48)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), ATTENTION_SHAPES)
def test_decode_attention_reads_each_sequence_at_its_slots(
    ops: Any, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int
) -> None:
    torch.manual_seed(2)
    lengths = torch.tensor([23, 1, 9, 17, 4])
    batch, ctx = len(lengths), int(lengths.max())
    k_cache = torch.randn(200, kv_heads, head_dim).to(dtype)
    v_cache = torch.randn(200, kv_heads, head_dim).to(dtype)
    slots = torch.randperm(200)[: batch * ctx].view(batch, ctx)
    q = torch.randn(batch, heads, head_dim).to(dtype)
    got = ops.decode_attention(q, k_cache, v_cache, slots, lengths, head_dim**-0.5)
    keys = k_cache[slots].float().transpose(1, 2)  # [batch, kv heads, ctx, dim]
    values = v_cache[slots].float().transpose(1, 2)
    mask = torch.arange(ctx)[None, :] < lengths[:, None]
    want = F.scaled_dot_product_attention(
        q.float()[:, :, None, :],
        keys,
        values,
        attn_mask=mask[:, None, None, :],
        scale=head_dim**-0.5,
        enable_gqa=True,
    ).squeeze(2)
    assert got.dtype == dtype and close(got, want)
    group = heads // kv_heads  # one position: its value, whatever the scores
    assert torch.equal(got[1], v_cache[slots[1, 0]].repeat_interleave(group, dim=0))


def test_bad_input_is_an_error_not_a_wild_read(ops: Any) -> None:
    q = torch.randn(2, HEADS, HEAD_DIM)
    cache = torch.randn(10, KV_HEADS, HEAD_DIM)
    slots = torch.tensor([[0, 1, 2], [3, 4, 10]])
    with pytest.raises(RuntimeError, match="outside the cache"):
        ops.decode_attention(q, cache, cache, slots, torch.tensor([3, 3]), 1.0)
    with pytest.raises(RuntimeError, match=r"not within 1\.\.3"):
        ops.decode_attention(q, cache, cache, slots, torch.tensor([3, 0]), 1.0)
    with pytest.raises(RuntimeError, match="must be float32"):
        ops.decode_attention(q, cache.half(), cache.half(), slots, torch.tensor([1, 1]), 1.0)
    qkv = torch.randn(1, (HEADS + 2 * KV_HEADS) * HEAD_DIM)
    rope = torch.ones(1, 1, HEAD_DIM)
    with pytest.raises(RuntimeError, match="outside the cache"):
        ops.rope_cache(qkv, rope, rope, cache, cache, torch.tensor([10]), HEADS, KV_HEADS)
    with pytest.raises(RuntimeError, match="weight"):
        ops.rms_norm(torch.randn(2, 8), torch.randn(8).bfloat16(), EPS)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_engine_runs_them_by_default_with_the_torch_forwards_tokens(
    tiny_model: Path, tmp_path: Path, dtype: str
) -> None:
    adapter = make_adapters(tiny_model, tmp_path / "adapters", n=2, ranks=(4,), strength=0.5)[1]
    llm = LLM(tiny_model, adapters={"a": adapter}, kv_cache_memory="4MiB", dtype=dtype)
    prompts = ["Hi", "The capital of France is", "A LoRA adapter changes the weights.", "Hi"]
    adapter_ids = [None, "a", None, "a"]
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    try:
        model = llm.engine.model
        assert model.fused  # the default on a CPU
        fused = llm.generate(prompts, params, adapter_ids=adapter_ids)
        model.fused = False
        plain = llm.generate(prompts, params, adapter_ids=adapter_ids)
        # The tiny model's logits are far apart: any difference here is a wrong result, not
        # a near tie rounded the other way.
        assert [o.token_ids for o in fused] == [o.token_ids for o in plain]
        for a, b in zip(fused, plain, strict=True):
            tolerance = 0.05 if dtype == "bfloat16" else 1e-4
            assert a.logprobs == pytest.approx(b.logprobs, abs=tolerance)
        llm.engine.check_no_leaks()
    finally:
        llm.engine.shutdown()
