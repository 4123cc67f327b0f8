"""The engine's greedy tokens equal transformers' own for each supported model family, and
checkpoints it cannot serve are refused with a clear ModelLoadError."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from transformers import (
    AutoModelForCausalLM,
    GPT2Config,
    GPT2LMHeadModel,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from lora_guard import LLM, SamplingParams
from lora_guard.demo.adapters import make_adapters
from lora_guard.demo.testing import make_tiny_llama, make_tiny_tokenizer, reference_greedy
from lora_guard.engine import ModelLoadError

NEW_TOKENS = 12
PARAMS = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
PROMPTS = [
    "Hi",
    "The capital of France is",
    "A LoRA adapter changes the attention and projection weights of a base model.",
    "Tenants send requests to one endpoint; each request names an adapter and a prompt. "
    "The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs.",
]
BLOCK_SIZE = 16


def randomize_biases(model_dir: Path, seed: int = 1) -> None:
    """HF initializes biases to zero; give them random values so they matter to the output."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0.0, 0.2)
    model.save_pretrained(model_dir, safe_serialization=True)


def save_family(out: Path, model_cls: Any, config_cls: Any, **overrides: Any) -> Path:
    """A seeded random checkpoint of another Llama-family architecture, with the tiny tokenizer."""
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = make_tiny_tokenizer(out)
    settings: dict[str, Any] = {
        "vocab_size": len(tokenizer),
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        "initializer_range": 0.2,
        "tie_word_embeddings": False,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    settings.update(overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = model_cls(config_cls(**settings)).to(torch.float32)
    model.save_pretrained(out, safe_serialization=True)
    return out


def llama_default(out: Path) -> Path:
    return make_tiny_llama(out)  # GQA (4 heads, 2 KV heads), tied embeddings


def llama_untied_biases(out: Path) -> Path:
    make_tiny_llama(out, tie_word_embeddings=False, attention_bias=True, mlp_bias=True)
    randomize_biases(out)
    return out


def llama3_rope(out: Path) -> Path:
    return make_tiny_llama(
        out,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    )


def qwen2(out: Path) -> Path:
    save_family(out, Qwen2ForCausalLM, Qwen2Config, use_sliding_window=False)
    randomize_biases(out)
    return out


def mistral(out: Path) -> Path:
    return save_family(out, MistralForCausalLM, MistralConfig, sliding_window=None)


def mistral_wide_heads(out: Path) -> Path:
    # head_dim set apart from hidden_size / num_heads (as in Mistral-Nemo)
    return save_family(out, MistralForCausalLM, MistralConfig, sliding_window=None, head_dim=32)


@pytest.mark.parametrize(
    "build",
    [
        pytest.param(llama_default, id="llama-gqa-tied"),
        pytest.param(llama_untied_biases, id="llama-untied-bias"),
        pytest.param(llama3_rope, id="llama3-rope"),
        pytest.param(qwen2, id="qwen2"),
        pytest.param(mistral, id="mistral"),
        pytest.param(mistral_wide_heads, id="mistral-head-dim"),
    ],
)
def test_greedy_tokens_match_transformers(build: Callable[[Path], Path], tmp_path: Path) -> None:
    model_dir = build(tmp_path / "model")
    llm = LLM(model_dir, kv_cache_memory="4MiB", block_size=BLOCK_SIZE, device="cpu")
    try:
        outs = llm.generate(PROMPTS, PARAMS)
        llm.engine.check_no_leaks()
    finally:
        llm.engine.shutdown()
    lengths = [len(o.prompt_token_ids) for o in outs]
    assert len(set(lengths)) == len(PROMPTS) and max(lengths) > 2 * BLOCK_SIZE, lengths
    for out in outs:
        assert out.finish_reason == "length" and len(out.token_ids) == NEW_TOKENS
    expected = reference_greedy(model_dir, [(o.prompt_token_ids, None) for o in outs], NEW_TOKENS)
    assert all(len(e) == NEW_TOKENS for e in expected)
    # a random model that repeats one token would make the comparison weak
    assert len({t for e in expected for t in e}) >= 8
    for prompt, out, want in zip(PROMPTS, outs, expected, strict=True):
        assert out.token_ids == want, f"prompt {prompt[:30]!r}: engine {out.token_ids} != {want}"


def test_biases_in_the_checkpoints_are_not_zero(tmp_path: Path) -> None:
    """The bias families above only test biases if the saved biases are non-zero."""
    qwen = load_file(qwen2(tmp_path / "qwen2") / "model.safetensors")
    llama = load_file(llama_untied_biases(tmp_path / "llama") / "model.safetensors")
    attention = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
    mlp = ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
    for tensors, names in ((qwen, attention), (llama, (*attention, "self_attn.o_proj", *mlp))):
        for name in names:
            bias = tensors[f"model.layers.1.{name}.bias"]
            assert bias.abs().max() > 0.05, name
    assert "model.layers.1.self_attn.o_proj.bias" not in qwen  # Qwen2 has no o_proj bias
    assert "lm_head.weight" in llama and "lm_head.weight" in qwen


def test_pickle_only_checkpoint_is_refused(tiny_model: Path, tmp_path: Path) -> None:
    folder = tmp_path / "pickled"
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    model.save_pretrained(folder, safe_serialization=False)
    make_tiny_tokenizer(folder)
    assert (folder / "pytorch_model.bin").is_file()
    assert not list(folder.glob("*.safetensors"))
    with pytest.raises(ModelLoadError) as info:
        LLM(folder, kv_cache_memory="4MiB", device="cpu")
    message = str(info.value)
    assert "pytorch_model.bin" in message and "pickle" in message and "safetensors" in message


def test_unsupported_model_type_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "gpt2"
    tokenizer = make_tiny_tokenizer(folder)
    config = GPT2Config(vocab_size=len(tokenizer), n_embd=64, n_layer=2, n_head=4, n_positions=128)
    GPT2LMHeadModel(config).save_pretrained(folder, safe_serialization=True)
    with pytest.raises(ModelLoadError) as info:
        LLM(folder, kv_cache_memory="4MiB", device="cpu")
    message = str(info.value)
    assert "'gpt2'" in message and "not supported" in message
    assert "llama" in message  # it says what is supported


def test_bfloat16_runs_base_and_adapter(tiny_model: Path, tmp_path: Path) -> None:
    adapter = make_adapters(tiny_model, tmp_path / "adapters", n=2, ranks=(4,), strength=0.5)[1]
    llm = LLM(
        tiny_model,
        adapters={"a": adapter},
        kv_cache_memory="4MiB",
        dtype="bfloat16",
        device="cpu",
    )
    try:
        assert llm.engine.model.embed.dtype == torch.bfloat16
        assert llm.engine.runner.kv_cache.k.dtype == torch.bfloat16
        vocab = llm.engine.model.spec.vocab_size
        adapter_ids = [None, "a", None, "a"]
        outs = llm.generate(PROMPTS, PARAMS, adapter_ids=adapter_ids)
        for out in outs:
            assert out.finish_reason == "length" and out.error is None
            assert len(out.token_ids) == NEW_TOKENS
            assert all(0 <= t < vocab for t in out.token_ids)
            assert len(out.logprobs) == NEW_TOKENS
            assert all(lp <= 0.0 and lp == lp for lp in out.logprobs)  # finite, not NaN
        llm.engine.check_no_leaks()
        # greedy is deterministic in bfloat16 too
        again = llm.generate(PROMPTS, PARAMS, adapter_ids=adapter_ids)
        assert [o.token_ids for o in again] == [o.token_ids for o in outs]
        llm.engine.check_no_leaks()
    finally:
        llm.engine.shutdown()


def test_bfloat16_decode_attention_on_the_cpu_is_torchs_float32_attention_rounded_once(
    tiny_model: Path,
) -> None:
    # The grouped float32 path that bfloat16 decodes take on the CPU: every query head against
    # its KV head, padded positions masked, within one bfloat16 rounding of float32 attention.
    llm = LLM(tiny_model, kv_cache_memory="4MiB", dtype="bfloat16", device="cpu")
    try:
        model, spec = llm.engine.model, llm.engine.model.spec
        torch.manual_seed(0)
        batch, ctx = 5, 23
        q = torch.randn(batch, spec.num_heads, spec.head_dim).bfloat16()
        k = torch.randn(batch, ctx, spec.num_kv_heads, spec.head_dim).bfloat16()
        v = torch.randn(batch, ctx, spec.num_kv_heads, spec.head_dim).bfloat16()
        mask = torch.arange(ctx)[None, :] < torch.tensor([23, 1, 9, 17, 4])[:, None]
        got = model._grouped_decode(q, k, v, mask)
        want = torch.nn.functional.scaled_dot_product_attention(
            q.float()[:, :, None, :],
            k.float().transpose(1, 2),
            v.float().transpose(1, 2),
            attn_mask=mask[:, None, None, :],
            scale=model.scale,
            enable_gqa=spec.num_heads != spec.num_kv_heads,
        ).squeeze(2)
        assert got.dtype == torch.bfloat16
        assert torch.allclose(got.float(), want, atol=0, rtol=2**-8)
        assert torch.equal(
            got[1].float(),
            v[1, 0].float().repeat_interleave(spec.num_heads // spec.num_kv_heads, dim=0),
        )  # one position: its value, whatever the scores
    finally:
        llm.engine.shutdown()
