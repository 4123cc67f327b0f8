"""The engine with the compiled layer operations and with torch's, in one process, taking turns.

    .venv/bin/python scripts/layer_ops_ab.py --dtype bfloat16 --turns 3

One engine on the demo model (`lora-guard prepare-demo`), prefix caching off. Each turn runs,
with the compiled operations (``layer_ops.cpp``) and then with torch's (``model.fused`` off):
one stream of 64 base-model tokens, and 32 requests over 8 adapters decoding 64 tokens together.
Prints the time a step takes (one token of each request) per turn, and the ratio of the two per
turn: taking turns inside one process keeps a shared machine's drift out of the ratios.
"""

from __future__ import annotations

import argparse
import statistics
import time

from lora_guard import LLM, SamplingParams
from lora_guard.demo.model import prepare_demo

TOKENS = 64


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--turns", type=int, default=3)
    args = parser.parse_args()
    demo = prepare_demo(log=lambda _msg: None)
    names = sorted(p.name for p in demo.adapter_dir.iterdir() if p.is_dir())[:8]
    llm = LLM(
        demo.model_dir,
        adapters={n: demo.adapter_dir / n for n in names},
        dtype=args.dtype,
        enable_prefix_caching=False,
        max_num_seqs=32,
    )
    params = SamplingParams(max_new_tokens=TOKENS, ignore_eos=True)
    cases = {
        "one stream, base model": ([list(range(100, 140))], [None]),
        "32 requests over 8 adapters": (
            [list(range(100 + i, 140 + i)) for i in range(32)],
            [names[i % len(names)] for i in range(32)],
        ),
    }
    model = llm.engine.model
    print(f"{args.dtype}, compiled layer operations: {model.fused}")
    for case, (prompts, ids) in cases.items():
        llm.generate(prompts, params, ids)  # warm-up
        steps: dict[bool, list[float]] = {True: [], False: []}
        for _ in range(args.turns):
            for fused in (True, False):
                model.fused = fused
                started = time.perf_counter()
                llm.generate(prompts, params, ids)
                steps[fused].append((time.perf_counter() - started) * 1000 / TOKENS)
        model.fused = True
        ratios = [a / b for a, b in zip(steps[True], steps[False], strict=True)]
        turns = {f: ", ".join(f"{v:.1f}" for v in steps[f]) for f in (True, False)}
        print(
            f"{case}: compiled {statistics.median(steps[True]):.1f} ms a step "
            f"({turns[True]}), torch's {statistics.median(steps[False]):.1f} ({turns[False]}); "
            f"step time compiled / torch's per turn {', '.join(f'{r:.3f}' for r in ratios)}, "
            f"median {statistics.median(ratios):.3f}"
        )
    llm.engine.shutdown()


if __name__ == "__main__":
    main()
