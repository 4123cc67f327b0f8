"""The engine on another device against transformers + PEFT on the same device: greedy tokens of
a mixed batch (several adapters and the base model, more adapters than seats) in float32 and
bfloat16, on a tiny random Llama made here, and the seconds of three ``generate`` calls of it.

    python scripts/cuda_check.py --device cuda [--cudnn-attention] [--json out.json]

Float32 must match the oracle token for token; bfloat16 is reported (rounding may flip a
near-tie). Exits 1 when float32 does not match. ``--cudnn-attention`` lets attention use
cuDNN's kernel too, which the engine leaves out (docs/engine.md).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch.nn.attention import SDPBackend

from lora_guard import LLM, SamplingParams
from lora_guard.demo.adapters import make_adapters
from lora_guard.demo.testing import make_tiny_llama, reference_greedy
from lora_guard.engine import model as model_module

NEW_TOKENS = 24
CALLS = 3


def engine(
    model: Path,
    adapters: dict[str, Path],
    requests: list[tuple[list[int], str | None]],
    device: str,
    dtype: str,
) -> tuple[list[list[int]], list[float]]:
    llm = LLM(
        model,
        adapters=dict(adapters),
        max_loras=4,
        device=device,
        dtype=dtype,
        lora_dtype=dtype,
        kv_cache_memory="64MiB",
        block_size=16,
    )
    try:
        seconds = []
        for _ in range(CALLS):
            started = time.perf_counter()
            outputs = llm.generate(
                [prompt for prompt, _ in requests],
                SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True),
                adapter_ids=[adapter for _, adapter in requests],
            )
            seconds.append(round(time.perf_counter() - started, 3))
        return [list(o.token_ids) for o in outputs], seconds
    finally:
        llm.engine.shutdown()


def compare(got: list[list[int]], want: list[list[int]]) -> dict[str, Any]:
    same = sum(g == w for g, w in zip(got, want, strict=True))
    first = [
        next((i for i, (a, b) in enumerate(zip(g, w, strict=True)) if a != b), None)
        for g, w in zip(got, want, strict=True)
    ]
    return {
        "requests": len(want),
        "identical": same,
        "first_divergence": [i for i in first if i is not None],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--cudnn-attention", action="store_true")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.cudnn_attention:
        model_module.ATTENTION_BACKENDS.append(SDPBackend.CUDNN_ATTENTION)
    report: dict[str, Any] = {
        "device": args.device,
        "torch": torch.__version__,
        "attention": [b.name for b in model_module.ATTENTION_BACKENDS],
    }
    if args.device.startswith("cuda"):
        report["gpu"] = torch.cuda.get_device_name(args.device)
    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_llama(
            Path(tmp) / "model",
            hidden_size=256,
            intermediate_size=512,
            num_hidden_layers=4,
            num_attention_heads=4,
        )
        folders = make_adapters(
            model,
            Path(tmp) / "adapters",
            n=8,
            ranks=(4, 8, 16, 32),
            prefix="c",
            all_projections=True,
        )
        adapters = {f.name: f for f in folders}
        rng = random.Random(0)
        names: list[str | None] = [*adapters, None]
        requests = [
            ([rng.randrange(5, 300) for _ in range(rng.randrange(4, 60))], names[i % 9])
            for i in range(36)
        ]
        files = [(prompt, None if a is None else adapters[a]) for prompt, a in requests]
        cpu_want = reference_greedy(model, files, NEW_TOKENS)
        for dtype in ("float32", "bfloat16"):
            want = reference_greedy(model, files, NEW_TOKENS, device=args.device, dtype=dtype)
            got, seconds = engine(model, adapters, requests, args.device, dtype)
            report[dtype] = {
                "against the oracle on the device": compare(got, want),
                "the oracle on the device against the CPU's float32": compare(want, cpu_want),
                "generate_s": seconds,
            }
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    f32 = report["float32"]["against the oracle on the device"]
    return 0 if f32["identical"] == f32["requests"] else 1


if __name__ == "__main__":
    sys.exit(main())
