"""Cost profiles: a model's shape, the device memory it leaves for KV and adapters, and every
cost the simulator and virtual time use on that device, each number with its source.

``--profile NAME`` in ``python -m lora_guard.bench.virtual_time`` and ``lora-guard simulate``.
Virtual time runs a tiny model whose widths are the profile's divided by one factor, so an
adapter's pages and a token's KV keep the real model's ratio; bytes are reported in the
profile's model (``Shape.scale``). Imports no torch.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lora_guard.engine.spec import LORA_TARGETS, projection_shape
from lora_guard.simulate_costs import MIB, Costs

TINY_LAYERS = 2
TINY_HIDDEN = 64  # the tiny model's hidden width is at least this
TINY_DTYPE_BYTES = 4  # the tiny model runs in float32


@dataclass(frozen=True)
class Shape:
    """What sizes an adapter and a token's KV: a Llama model's widths and its dtype."""

    model: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    dtype_bytes: int  # weights, adapters and KV

    @property
    def kv_width(self) -> int:
        return self.kv_heads * self.hidden // self.heads

    def projection(self, name: str) -> tuple[int, int]:
        """``name``'s input and output widths."""
        return projection_shape(name, self.hidden, self.hidden, self.kv_width, self.intermediate)

    def lora_bytes(self, rank: int, targets: tuple[str, ...] = LORA_TARGETS) -> int:
        """An adapter's bytes: A (rank x in) and B (out x rank) on each target, every layer."""
        return rank * sum(sum(self.projection(t)) for t in targets) * self.layers * self.dtype_bytes

    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_width * self.dtype_bytes

    def tiny(self) -> Shape:
        """The widths divided by the largest factor that divides all three and leaves the hidden
        width at least :data:`TINY_HIDDEN`; two float32 layers; heads of 16, 8, 4 or 2."""
        common = math.gcd(self.hidden, self.intermediate, self.kv_width)
        factor = max(
            d for d in range(1, common + 1) if common % d == 0 and self.hidden // d >= TINY_HIDDEN
        )
        hidden, kv = self.hidden // factor, self.kv_width // factor
        head = next(w for w in (16, 8, 4, 2) if hidden % w == 0 and kv % w == 0)
        return Shape(
            f"tiny {self.model}",
            hidden,
            self.intermediate // factor,
            TINY_LAYERS,
            hidden // head,
            kv // head,
            TINY_DTYPE_BYTES,
        )

    def tiny_config(self) -> dict[str, Any]:
        """``make_tiny_llama``'s keywords for :meth:`tiny`."""
        tiny = self.tiny()
        return {
            "hidden_size": tiny.hidden,
            "intermediate_size": tiny.intermediate,
            "num_hidden_layers": tiny.layers,
            "num_attention_heads": tiny.heads,
            "num_key_value_heads": tiny.kv_heads,
        }

    @classmethod
    def of_checkpoint(cls, model: Path, dtype_bytes: int = TINY_DTYPE_BYTES) -> Shape:
        """The shape in a checkpoint's ``config.json``."""
        config = json.loads((model / "config.json").read_text())
        heads = config["num_attention_heads"]
        return cls(
            str(model),
            config["hidden_size"],
            config["intermediate_size"],
            config["num_hidden_layers"],
            heads,
            config.get("num_key_value_heads", heads),
            dtype_bytes,
        )

    def scale(self, model: Path) -> float:
        """Bytes on this shape per byte of the same adapter (or KV) on the checkpoint ``model``
        (float32), which must have this shape's proportions."""
        here = Shape.of_checkpoint(model)
        ratio = self.lora_bytes(1) / here.lora_bytes(1)
        if not math.isclose(ratio, self.kv_bytes_per_token() / here.kv_bytes_per_token()):
            raise ValueError(
                f"{model} is not {self.model} scaled down: its adapters and KV scale apart"
            )
        return ratio


@dataclass(frozen=True)
class Profile:
    """A deployment the simulators stand for: a model's shape on a device, and the costs."""

    name: str
    summary: str
    device: str
    shape: Shape
    memory_bytes: int  # device memory left for KV and adapters once the weights are in
    costs: Costs
    weights_bytes: int  # the model's weights on the device
    device_bytes: int  # the device's memory as the framework sees it
    sources: dict[str, str] = field(default_factory=dict)  # a Costs field (or memory) -> source

    def describe(self) -> str:
        return f"{self.name}: {self.summary}"


SMOLLM2_135M = Shape("SmolLM2-135M", 576, 1536, 30, 9, 3, 4)
LLAMA2_7B = Shape("Llama-2-7B", 4096, 11008, 32, 32, 32, 2)
LLAMA3_8B = Shape("Llama-3-8B", 4096, 14336, 32, 32, 8, 2)


def _gpu_costs(shape: Shape, source: str, **ms: float) -> Costs:
    """A GPU host's costs: ``ms``, and the adapter read and copy launches ``GPU_ADAPTER_IO``
    gives the sources of."""
    io = {"read_ms": 25.0, "read_per_mib_ms": 0.5, "write_ms": 3.0}
    return Costs(**io, **ms, adapter_mib=shape.lora_bytes(16) / MIB, source=source)


CPU_DEMO = Profile(
    "cpu-demo",
    "SmolLM2-135M in float32 on a quiet 2-core CPU (the engine's own calibration)",
    "a 2-core CPU",
    SMOLLM2_135M,
    8 << 30,
    Costs(),
    int(134.5e6 * 4),
    32 << 30,
    {
        "costs": "lora-guard simulate --calibrate docs/simulate-costs.json (docs/simulate.md)",
        "step_lora_ms": "0: the calibration's fitted fixed part holds it",
        "memory": "what lora-guard serve takes for the demo without --cache-memory on a host "
        "with 32 GiB free (the need of 64 requests of 8,192 tokens, capped at a quarter of free "
        "memory)",
    },
)

#: the sources of ``_gpu_costs``'s adapter read (the framework's fixed part and an NVMe's 2 GB/s)
#: and copy launches
GPU_ADAPTER_IO = {
    "read_ms": "huggingface/peft issue 981: the first adapter's load took 27.32 ms, the second "
    "24.29 ms (framework fixed part; assumed the same on both hosts)",
    "read_per_mib_ms": "assumed: a cold read from an NVMe drive at 2 GB/s (0.1 ms/MiB from the "
    "page cache)",
    "write_ms": "assumed: the copy launches of an adapter's tensors (one per A or B matrix)",
}

A10_7B = Profile(
    "a10-7b",
    "Llama-2-7B in fp16 on an NVIDIA A10 24 GB (the seed's hardware), published figures",
    "NVIDIA A10 24 GB (600 GB/s, 125 TFLOPS fp16, PCIe Gen4)",
    LLAMA2_7B,
    int(6.8 * (1 << 30)),
    _gpu_costs(
        LLAMA2_7B,
        "profile a10-7b: Llama-2-7B fp16 on an A10, published figures (docs/simulate.md)",
        step_ms=27.0,
        step_per_seq_ms=0.45,
        step_per_adapter_mib_ms=0.0035,
        step_lora_ms=2.1,
        prefill_per_token_ms=0.20,
        write_per_mib_ms=0.054,
    ),
    int(12.5562 * (1 << 30)),
    23028 << 20,
    {
        "step_ms": "InternLM/lmdeploy issue 210: Llama-2-7B on one A10, about 27 ms per token at "
        "batch 1 (34 ms with transformers); the weights' roofline is 22.5 ms (13.5 GB at 600 GB/s)",
        "step_per_seq_ms": "roofline: a sequence's KV read, 500 tokens x 0.5 MiB at 600 GB/s = "
        "0.45 ms; S-LoRA's A10G result files fit about 0.8 ms with its LoRA kernels included",
        "step_per_adapter_mib_ms": "roofline: 1 MiB at half of 600 GB/s (the gather kernels' "
        "share of the bandwidth)",
        "step_lora_ms": "S-LoRA repository, A10G, benchmarks/a10g: turning its LoRA kernels off "
        "raises throughput 6.4% (1 adapter) to 7.5% (500 adapters), about 2.1 ms of a 33 ms step",
        "prefill_per_token_ms": "roofline: 13.5 GFLOP a token at 55% of 125 TFLOPS",
        **GPU_ADAPTER_IO,
        "write_per_mib_ms": "measured pinned host-to-device copy on an A10, 19.6 GB/s "
        "(drkennetz/cuda_examples pull request 1)",
        "memory": "0.9 of 22.5 GiB less 12.55 GiB of weights (vLLM's load log, vllm pull request "
        "6234) and about 1 GiB of activations; S-LoRA's A10G launcher sizes its pool at 14,000 "
        "tokens (6.8 GiB)",
    },
)

H100_8B = Profile(
    "h100-8b",
    "Llama-3-8B in bf16 on an NVIDIA H100 80 GB SXM, published figures",
    "NVIDIA H100 80 GB SXM (3.35 TB/s, 989 TFLOPS bf16, PCIe Gen5)",
    LLAMA3_8B,
    54 << 30,
    _gpu_costs(
        LLAMA3_8B,
        "profile h100-8b: Llama-3-8B bf16 on an H100, published figures (docs/simulate.md)",
        step_ms=7.0,
        step_per_seq_ms=0.02,
        step_per_adapter_mib_ms=0.0006,
        step_lora_ms=1.0,
        prefill_per_token_ms=0.03,
        write_per_mib_ms=0.028,
    ),
    int(14.9888 * (1 << 30)),
    81559 << 20,
    {
        "step_ms": "LambdaLabsML/vllm-benchmark, results/prompt_10/1xH100-80GB-SXM, "
        "Meta-Llama-3-8B-Instruct (vLLM 0.6.0): 70-71 ms per 10 tokens with one request left",
        "step_per_seq_ms": "the same repository's prompt_160 run: about 9.7 ms a step with about "
        "150 running against 7.0 at one, (9.7 - 7.0) / 150 = 0.018 ms",
        "step_per_adapter_mib_ms": "roofline: 1 MiB at half of 3.35 TB/s",
        "step_lora_ms": "estimate: two kernel launches per projection and layer (448 at about 2 "
        "us); Punica reports about 2 ms a token on an A100",
        "prefill_per_token_ms": "LambdaLabsML/vllm-benchmark prompt_10: 1,369 prompt tokens, TTFT "
        "62 ms (at most 0.046 ms a token, fixed part included); roofline 0.016",
        **GPU_ADAPTER_IO,
        "write_per_mib_ms": "measured host-to-device copy on an H100 host, 35.3 GB/s "
        "(NVIDIA/nvbandwidth issue 24)",
        "memory": "0.9 of 79.2 GiB less 15 GiB of weights (vLLM's load log, vllm issue 10517) and "
        "2 GiB of activations and graphs; TensorRT-LLM issue 6294 allocates 52.5 GiB of KV for "
        "the same model on an H100",
    },
)

PROFILES: dict[str, Profile] = {p.name: p for p in (CPU_DEMO, A10_7B, H100_8B)}


def profile(name: str) -> Profile:
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(f"unknown profile {name!r}; choose from {', '.join(PROFILES)}") from None


def profiles_help() -> str:
    return "; ".join(p.describe() for p in PROFILES.values())


#: each cost as the docs name it, with its unit
COST_ROWS = (
    ("step_ms", "step, fixed", "ms"),
    ("step_per_seq_ms", "step, per sequence", "ms"),
    ("step_per_adapter_mib_ms", "step, per MiB of adapter weights read", "ms"),
    ("step_lora_ms", "step, when it reads any adapter", "ms"),
    ("prefill_per_token_ms", "step, per prefill token", "ms"),
    ("read_ms", "read from disk, fixed", "ms"),
    ("read_per_mib_ms", "read from disk, per MiB", "ms"),
    ("write_ms", "copy into the pool, fixed", "ms"),
    ("write_per_mib_ms", "copy into the pool, per MiB", "ms"),
)


BEGIN, END = "<!-- profiles: begin -->", "<!-- profiles: end -->"


def profiles_markdown() -> str:
    """The profiles as docs/simulate.md shows them (``python -m lora_guard.cost_profiles``)."""
    out = [BEGIN, ""]
    for p in PROFILES.values():
        shape = p.shape
        out += [
            f"### `{p.name}`: {p.summary}",
            "",
            f"{shape.model} ({shape.layers} layers, hidden {shape.hidden}, intermediate "
            f"{shape.intermediate}, {shape.heads} heads, {shape.kv_heads} KV heads, "
            f"{shape.dtype_bytes} bytes a value) on {p.device}: a token's KV "
            f"{shape.kv_bytes_per_token() / 1024:g} KiB, an adapter of rank 16 on every "
            f"projection {shape.lora_bytes(16) / MIB:.4g} MiB; virtual time's tiny model is "
            f"{shape.tiny().hidden} / {shape.tiny().intermediate} / {shape.tiny().kv_width} wide "
            f"(bytes x{shape.lora_bytes(1) / shape.tiny().lora_bytes(1):g}).",
            "",
            "| cost | value | source |",
            "|---|---:|---|",
        ]
        general = p.sources.get("costs", "")
        for name, label, unit in COST_ROWS:
            value = getattr(p.costs, name)
            out.append(f"| {label} | {value:g} {unit} | {p.sources.get(name, general)} |")
        out.append(
            f"| memory for KV and adapters | {p.memory_bytes / (1 << 30):g} GiB | "
            f"{p.sources['memory']} |"
        )
        out.append("")
    return "\n".join([*out, END])


if __name__ == "__main__":
    print(profiles_markdown())
