"""A Llama-family decoder (Llama, Mistral, Qwen2, SmolLM) over a flat batch with paged KV.

One forward runs the tokens of many sequences at once: prefill chunks and single-token decodes,
each sequence possibly under its own LoRA adapter. Attention reads and writes the paged KV cache;
the LoRA update of every projection is added by the step's ``LoraBatch`` (``engine/lora/compute``).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch.nn.attention import SDPBackend, sdpa_kernel

from lora_guard.engine import native
from lora_guard.engine.linear import Linear, blocked_layout_available
from lora_guard.engine.spec import FUSED_PROJECTIONS, ModelLoadError, ModelSpec

# Not cuDNN's: it builds a plan for every new shape, and a batch's lengths change every step
# (bfloat16 on an H200: three calls of one batch 2.6-6.2x slower than with these, docs/engine.md).
ATTENTION_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
FUSED_DTYPES = (torch.float32, torch.bfloat16)  # what layer_ops.cpp computes in

if TYPE_CHECKING:
    from lora_guard.engine.lora.compute import LoraBatch


@dataclass(slots=True)
class AttentionBatch:
    """Where each sequence's queries sit in the flat batch and where its keys live in the cache.

    ``prefills`` run one attention call each: (query start, query length, context length, cache
    slots of the context). Single-token decodes are batched: ``decode_rows`` index the flat batch
    in order (without prefills, every row is a decode: ``decode_rows`` is 0, 1, ...),
    ``decode_slots`` [B, C] the cache, of which each row's first ``decode_lengths`` [B] are its
    context.
    """

    slot_mapping: torch.Tensor
    prefills: list[tuple[int, int, int, torch.Tensor]]
    decode_rows: torch.Tensor | None
    decode_slots: torch.Tensor | None
    decode_lengths: torch.Tensor | None


@dataclass(slots=True)
class Layer:
    """One decoder layer's weights: its two norms and its four (fused) projections."""

    input_norm: torch.Tensor
    post_norm: torch.Tensor
    projections: dict[str, Linear]  # keyed like FUSED_PROJECTIONS

    @property
    def norms(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.input_norm, self.post_norm


def rope_inv_freq(config: Any, head_dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and attention scaling for the RoPE the config asks for."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        theta = getattr(config, "rope_theta", None) or params.get("rope_theta") or 10000.0
        dim = int(head_dim * getattr(config, "partial_rotary_factor", 1.0))
        inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        return inv, 1.0
    if rope_type == "dynamic":
        raise ModelLoadError("dynamic NTK RoPE scaling is not supported")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ModelLoadError(f"RoPE type {rope_type!r} is not supported")
    inv, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))
    return inv.float(), float(scaling)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Normalised in float32, rounded to ``x``'s dtype, then scaled (as transformers' Llama)."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Apply RoPE to x [T, heads, head_dim] with cos and ``signed_sin`` [T, 1, head_dim] (sin,
    its first half negated): ``x * cos + cat(-x2, x1) * sin`` with the halves swapped by one
    roll, the same products and sum."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * signed_sin


class LlamaModel:
    """Weights and the forward pass. Owns no cache and no adapters; both are passed in."""

    def __init__(
        self,
        model_dir: Path,
        dtype: torch.dtype,
        device: torch.device,
        *,
        blocked: bool | None = None,
        rows: bool | None = None,
    ) -> None:
        """``blocked``: keep the projections in oneDNN's blocked layout (default: where it is
        available, see ``engine/linear``); ``rows``: also keep their rows for decode steps of
        a few sequences, multiplied by the compiled row kernel (default: where the compiled
        operations load)."""
        from transformers import AutoConfig

        self.config = AutoConfig.from_pretrained(model_dir)
        self.spec = ModelSpec.from_config(self.config)
        self.dtype, self.device = dtype, device
        weights = _load_safetensors(model_dir, self.spec)
        s = self.spec

        def w(name: str) -> torch.Tensor:
            if name not in weights:
                raise ModelLoadError(f"{model_dir} lacks the tensor {name}")
            return weights.pop(name).to(device=device, dtype=dtype).contiguous()

        #: the layers' small operations compiled (``layer_ops.cpp``): on a CPU, where they build
        self.fused = device.type == "cpu" and dtype in FUSED_DTYPES and native.load()
        self.embed = w("model.embed_tokens.weight")
        self.blocked = blocked_layout_available(dtype, device) if blocked is None else blocked
        self.rows = self.fused if rows is None else rows
        if self.rows and not self.fused:
            raise ModelLoadError(
                f"the row kernel needs the compiled operations on a CPU in float32 or bfloat16 "
                f"({native.error() or f'{device.type}, {dtype}'})"
            )
        head = self.embed if s.tie_word_embeddings else w("lm_head.weight")
        # A tied head multiplies the embedding table itself, unless it gets another layout.
        self.lm_head: Linear | torch.Tensor = (
            Linear(head, None, blocked=self.blocked, rows=self.rows)
            if self.blocked or self.rows
            else head
        )
        self.norm = w("model.norm.weight")
        self.layers: list[Layer] = []

        def linear(names: tuple[str, ...], prefix: str, bias: bool) -> Linear:
            weight = torch.cat([w(f"{prefix}{m}.weight") for m in names])
            b = torch.cat([w(f"{prefix}{m}.bias") for m in names]).contiguous() if bias else None
            return Linear(weight, b, blocked=self.blocked, rows=self.rows)

        for i in range(s.num_layers):
            p = f"model.layers.{i}."
            attn, mlp = p + "self_attn.", p + "mlp."
            self.layers.append(
                Layer(
                    input_norm=w(p + "input_layernorm.weight"),
                    post_norm=w(p + "post_attention_layernorm.weight"),
                    projections={
                        "qkv": linear(FUSED_PROJECTIONS["qkv"], attn, s.qkv_bias),
                        "o": linear(FUSED_PROJECTIONS["o"], attn, s.o_bias),
                        "gate_up": linear(FUSED_PROJECTIONS["gate_up"], mlp, s.mlp_bias),
                        "down": linear(FUSED_PROJECTIONS["down"], mlp, s.mlp_bias),
                    },
                )
            )
        self._pristine: dict[tuple[int, str], torch.Tensor] = {}
        inv_freq, self.rope_scaling = rope_inv_freq(self.config, s.head_dim)
        self.inv_freq = inv_freq.to(device)
        self.scale = 1.0 / math.sqrt(s.head_dim)

    def merge_lora(
        self,
        weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]],
        *,
        reversible: bool = True,
    ) -> None:
        """Add ``B @ A`` (scaling folded into B) into the base weights, undoing any earlier merge.

        A reversible merge keeps the original rows it changes, so :meth:`unmerge_lora` restores
        them exactly.
        """
        self.unmerge_lora()
        deltas: dict[tuple[int, str], list[tuple[int, int, torch.Tensor, torch.Tensor]]] = {}
        for (layer, module), (a, b) in weights.items():
            projection, start, end = self.spec.fused_rows(module)
            deltas.setdefault((layer, projection), []).append((start, end, a, b))
        # One projection at a time: a merge holds one plain copy beside the weights.
        for (layer, projection), updates in deltas.items():
            linear = self.layers[layer].projections[projection]
            weight = linear.dense()
            if reversible:
                self._pristine[layer, projection] = weight.clone()
            for start, end, a, b in updates:
                delta = b.to(self.device, torch.float32) @ a.to(self.device, torch.float32)
                weight[start:end] += delta.to(weight.dtype)
            linear.replace(weight)

    def unmerge_lora(self) -> None:
        for (layer, projection), original in self._pristine.items():
            self.layers[layer].projections[projection].replace(original)
        self._pristine.clear()

    def merge_copy_bytes(self) -> int:
        """Bytes of the original weights a reversible merge keeps aside."""
        return sum(t.numel() * t.element_size() for t in self._pristine.values())

    def merge_transient_bytes(self) -> int:
        """The most a merge holds beside the weights and the copies it keeps: one projection's
        plain copy, its update and its new weight before the old one is let go."""
        largest = max(p.nbytes for layer in self.layers for p in layer.projections.values())
        return 3 * largest

    def weight_bytes(self) -> int:
        """Bytes the weights hold, each tensor once (a tied head's rows are the embedding table)."""
        tensors = [self.embed, self.norm, *(t for layer in self.layers for t in layer.norms)]
        linears = [p for layer in self.layers for p in layer.projections.values()]
        if isinstance(self.lm_head, Linear):
            linears.append(self.lm_head)
        elif self.lm_head is not self.embed:
            tensors.append(self.lm_head)
        held = {id(t): t for t in [*tensors, *(t for p in linears for t in p.tensors())]}
        return sum(t.numel() * t.element_size() for t in held.values())

    def step_bytes(self) -> int:
        """Bytes of weights one step reads: each projection's weight in one layout, the norms
        and the head; the embedding table only where the head multiplies it (a step gathers
        just its rows from it)."""
        norms = [self.norm, *(t for layer in self.layers for t in layer.norms)]
        linears = [p for layer in self.layers for p in layer.projections.values()]
        head = self.lm_head
        read = sum(t.numel() * t.element_size() for t in norms) + sum(p.read_bytes for p in linears)
        if isinstance(head, Linear):
            return read + head.read_bytes
        return read + head.numel() * head.element_size()

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionBatch,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        lora: LoraBatch | None,
        logits_rows: torch.Tensor,
    ) -> torch.Tensor:
        """Logits [len(logits_rows), vocab] for the requested rows of the flat batch."""
        x = F.embedding(input_ids, self.embed)
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = (emb.cos() * self.rope_scaling).to(self.dtype)[:, None, :]
        sin = (emb.sin() * self.rope_scaling).to(self.dtype)[:, None, :]
        half = sin.shape[-1] // 2
        signed_sin = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
        layers = self._fused_layers if self.fused else self._layers
        with sdpa_kernel(ATTENTION_BACKENDS):
            x = layers(x, cos, signed_sin, attn, kv_cache, lora)
        rows, eps = x[logits_rows], self.spec.rms_norm_eps
        h = (
            torch.ops.lora_guard.rms_norm(rows, self.norm, eps)
            if self.fused
            else rms_norm(rows, self.norm, eps)
        )
        head = self.lm_head
        logits = head(h) if isinstance(head, Linear) else F.linear(h, head)
        return logits.float()

    def _layers(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        signed_sin: torch.Tensor,
        attn: AttentionBatch,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        lora: LoraBatch | None,
    ) -> torch.Tensor:
        """The decoder layers in torch's operations."""
        s = self.spec
        heads, kv_heads = s.num_heads, s.num_kv_heads
        qk_size = (heads + kv_heads) * s.head_dim  # queries and keys, rotated together
        k_cache, v_cache = kv_cache
        for i, layer in enumerate(self.layers):
            h = rms_norm(x, layer.input_norm, s.rms_norm_eps)
            qkv = self._linear(h, layer, "qkv", i, lora)
            qk = rotate(qkv[:, :qk_size].view(-1, heads + kv_heads, s.head_dim), cos, signed_sin)
            q, k = qk[:, :heads], qk[:, heads:]
            v = qkv[:, qk_size:].view(-1, kv_heads, s.head_dim)
            k_cache[i].index_copy_(0, attn.slot_mapping, k)
            v_cache[i].index_copy_(0, attn.slot_mapping, v)
            o = self._attention(q, k_cache[i], v_cache[i], attn)
            x = x + self._linear(o, layer, "o", i, lora)
            h = rms_norm(x, layer.post_norm, s.rms_norm_eps)
            gate, up = self._linear(h, layer, "gate_up", i, lora).chunk(2, dim=-1)
            x = x + self._linear(F.silu(gate) * up, layer, "down", i, lora)
        return x

    def _fused_layers(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        signed_sin: torch.Tensor,
        attn: AttentionBatch,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        lora: LoraBatch | None,
    ) -> torch.Tensor:
        """The same layers with the compiled operations (``layer_ops.cpp``) in place of the
        small ones: each residual add joins the next norm, and ``x`` is added to in place."""
        s, ops = self.spec, torch.ops.lora_guard
        eps, heads, kv_heads = s.rms_norm_eps, s.num_heads, s.num_kv_heads
        cos, signed_sin = cos.contiguous(), signed_sin.contiguous()
        k_layers, v_layers = kv_cache[0].unbind(0), kv_cache[1].unbind(0)
        down: torch.Tensor | None = None  # the last layer's output, not yet added to x
        for i, layer in enumerate(self.layers):
            if down is None:
                h = ops.rms_norm(x, layer.input_norm, eps)
            else:
                h = ops.add_rms_norm(x, down, layer.input_norm, eps)
            qkv = self._linear(h, layer, "qkv", i, lora)
            k_cache, v_cache = k_layers[i], v_layers[i]
            q = ops.rope_cache(
                qkv, cos, signed_sin, k_cache, v_cache, attn.slot_mapping, heads, kv_heads
            )
            o = self._attention(q, k_cache, v_cache, attn)
            h = ops.add_rms_norm(x, self._linear(o, layer, "o", i, lora), layer.post_norm, eps)
            up = ops.silu_mul(self._linear(h, layer, "gate_up", i, lora))
            down = self._linear(up, layer, "down", i, lora)
        return x if down is None else x + down

    def _linear(
        self, x: torch.Tensor, layer: Layer, projection: str, index: int, lora: LoraBatch | None
    ) -> torch.Tensor:
        y = layer.projections[projection](x)
        if lora is not None:
            lora.apply(x, y, index, projection)
        return y

    def _attention(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, attn: AttentionBatch
    ) -> torch.Tensor:
        s = self.spec
        if not attn.prefills and attn.decode_rows is not None:  # every row a decode, in order
            return self._decodes(q, k_cache, v_cache, attn).view(q.shape[0], -1)
        out = torch.empty_like(q)
        gqa = s.num_heads != s.num_kv_heads
        for start, q_len, ctx_len, slots in attn.prefills:
            qs = q[start : start + q_len].transpose(0, 1)[None]
            ks = k_cache.index_select(0, slots).transpose(0, 1)[None]
            vs = v_cache.index_select(0, slots).transpose(0, 1)[None]
            if ctx_len == q_len:
                mask = None
            else:
                cols = torch.arange(ctx_len, device=q.device)
                rows = torch.arange(ctx_len - q_len, ctx_len, device=q.device)
                mask = cols[None, :] <= rows[:, None]
            o = F.scaled_dot_product_attention(
                qs,
                ks,
                vs,
                attn_mask=mask,
                is_causal=mask is None,
                scale=self.scale,
                enable_gqa=gqa,
            )
            out[start : start + q_len] = o[0].transpose(0, 1)
        if attn.decode_rows is not None:
            out[attn.decode_rows] = self._decodes(q[attn.decode_rows], k_cache, v_cache, attn)
        return out.view(q.shape[0], -1)

    def _decodes(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, attn: AttentionBatch
    ) -> torch.Tensor:
        """The single-token decodes' attention: q [B, heads, D], one row per decode."""
        s = self.spec
        assert attn.decode_slots is not None and attn.decode_lengths is not None
        if self.fused:  # read at the slots, no gather
            o: torch.Tensor = torch.ops.lora_guard.decode_attention(
                q, k_cache, v_cache, attn.decode_slots, attn.decode_lengths, self.scale
            )
            return o
        batch, ctx = attn.decode_slots.shape
        flat = attn.decode_slots.flatten()
        kd = k_cache.index_select(0, flat).view(batch, ctx, s.num_kv_heads, s.head_dim)
        vd = v_cache.index_select(0, flat).view(batch, ctx, s.num_kv_heads, s.head_dim)
        grouped = self.device.type == "cpu" and self.dtype != torch.float32
        decode = self._grouped_decode if grouped else self._torch_decode
        mask = torch.arange(ctx, device=q.device)[None, :] < attn.decode_lengths[:, None]
        return decode(q, kd, vd, mask)

    def _torch_decode(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """torch's attention kernel, one query per sequence (shapes as ``_grouped_decode``)."""
        o = F.scaled_dot_product_attention(
            q[:, :, None, :],
            k.transpose(1, 2),
            v.transpose(1, 2),
            attn_mask=mask[:, None, None, :],
            scale=self.scale,
            enable_gqa=self.spec.num_heads != self.spec.num_kv_heads,
        )
        return o.squeeze(2)

    def _grouped_decode(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """One query per sequence, in float32, each KV head's query heads as one group (no copy
        of K or V per query head): torch's CPU attention in bfloat16 is slower for these
        shapes, and rounds more (docs/engine.md). q [B, heads, D]; k, v [B, ctx, KV
        heads, D]; mask [B, ctx], True where a sequence attends."""
        s = self.spec
        batch, group = q.shape[0], s.num_heads // s.num_kv_heads
        qg = q.view(batch, s.num_kv_heads, group, s.head_dim).float()
        scores = torch.matmul(qg, k.permute(0, 2, 3, 1).float()) * self.scale
        scores.masked_fill_(~mask[:, None, None, :], float("-inf"))
        o = torch.matmul(scores.softmax(-1), v.transpose(1, 2).float())
        return o.view(batch, s.num_heads, s.head_dim).to(q.dtype)


def _load_safetensors(model_dir: Path, spec: ModelSpec) -> dict[str, torch.Tensor]:
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        pickles = [p.name for p in model_dir.iterdir() if p.suffix in (".bin", ".pt", ".pth")]
        if pickles:
            raise ModelLoadError(
                f"{model_dir} holds only pickle weights ({', '.join(pickles)}); lora-guard loads "
                "safetensors only, because pickle files can run code. Convert them with "
                "`model.save_pretrained(dir, safe_serialization=True)`."
            )
        raise ModelLoadError(f"{model_dir} has no *.safetensors weights")
    index_file = model_dir / "model.safetensors.index.json"
    if index_file.exists():
        names = set(json.loads(index_file.read_text())["weight_map"].values())
        files = [model_dir / n for n in sorted(names)]
    weights: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                weights[key] = f.get_tensor(key)
    needed = ["model.embed_tokens.weight", "model.norm.weight"]
    if not spec.tie_word_embeddings:
        needed.append("lm_head.weight")
    missing = [n for n in needed if n not in weights]
    if missing:
        raise ModelLoadError(f"{model_dir} lacks tensors: {', '.join(missing)}")
    return weights
