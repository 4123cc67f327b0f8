"""The engine with blocked and with plain base weights, in one process, taking turns.

    .venv/bin/python scripts/weight_layout_ab.py --dtype bfloat16 --turns 6

Two engines on the demo model (`lora-guard prepare-demo`), prefix caching off, one per weight
layout. Each turn runs, in each engine in turn: one stream of 64 tokens for an adapter, one for
the base model, and 32 requests over 8 adapters (32 tokens each). Taking turns inside one process
keeps a shared machine's drift out of the ratios better than runs minutes apart.
"""

from __future__ import annotations

import argparse
import statistics
import time

from lora_guard import LLM, SamplingParams
from lora_guard.demo.model import prepare_demo

WORDS = "the quick brown fox jumps over a lazy dog while it rains on the hills".split()  # noqa: SIM905


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--turns", type=int, default=6)
    args = parser.parse_args()
    demo = prepare_demo()
    engines = {
        layout: LLM(
            demo.model_dir,
            demo.adapter_dir,
            dtype=args.dtype,
            max_loras=8,
            weight_layout=layout,
            enable_prefix_caching=False,
        )
        for layout in ("blocked", "plain")
    }
    prompts = [" ".join(WORDS[(i + j) % len(WORDS)] for j in range(40 + i)) for i in range(32)]
    adapters = [f"demo-0{i % 8}" for i in range(32)]
    batch, stream = (
        SamplingParams(max_new_tokens=32, ignore_eos=True),
        SamplingParams(max_new_tokens=64, ignore_eos=True),
    )
    tokens = {}
    for layout, llm in engines.items():
        llm.generate(prompts[:8], batch, adapters[:8])  # warm-up
        tokens[layout] = [o.token_ids for o in llm.generate(prompts, batch, adapters)]
    same = sum(a == b for a, b in zip(tokens["blocked"], tokens["plain"], strict=True))
    print(f"{args.dtype}: the same greedy tokens for {same} of 32 requests")
    runs = {
        "one stream, adapter": (prompts[0], stream, "demo-01", 64),
        "one stream, base": (prompts[1], stream, None, 64),
        "32 requests, 8 adapters": (prompts, batch, adapters, 32 * 32),
    }
    rates: dict[str, dict[str, list[float]]] = {w: {"blocked": [], "plain": []} for w in runs}
    for _ in range(args.turns):
        for layout, llm in engines.items():
            for what, (prompt, params, adapter, count) in runs.items():
                start = time.perf_counter()
                llm.generate(prompt, params, adapter)
                rates[what][layout].append(count / (time.perf_counter() - start))
    for what, found in rates.items():
        ratios = sorted(b / p for b, p in zip(found["blocked"], found["plain"], strict=True))
        print(
            f"{what}: blocked / plain tok/s, median {statistics.median(ratios):.2f}x "
            f"({ratios[0]:.2f}-{ratios[-1]:.2f}, {args.turns} turns); median tok/s blocked "
            f"{statistics.median(found['blocked']):.1f}, "
            f"plain {statistics.median(found['plain']):.1f}"
        )


if __name__ == "__main__":
    main()
