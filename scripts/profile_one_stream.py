"""Where a decode step's time goes in the engine: the demo model, one request (or a batch),
token by token.

    .venv/bin/python scripts/profile_one_stream.py --dtype bfloat16 --turns 3
    .venv/bin/python scripts/profile_one_stream.py --dtype bfloat16 --batch 32 --adapters 8

Runs `--batch` requests of 64 new tokens together (after a warm-up), `--turns` times, and prints
the time a step takes (one token of each request); then once more under torch's profiler, with
the self time of torch's operations a step split into the base model's linear layers (the
weight bytes every step reads), attention and every other operation. What the step time leaves
over is Python (the forward's glue, the scheduler, sampling). With `--adapter ID`, every request
runs under that demo adapter; with `--adapters N`, the requests cycle over the first N.
"""

from __future__ import annotations

import argparse
import statistics
import time

from torch.profiler import ProfilerActivity, profile

from lora_guard import LLM, SamplingParams
from lora_guard.demo.model import prepare_demo

LINEAR = ("mkldnn::_linear_pointwise", "aten::addmm", "aten::mm", "aten::linear", "aten::matmul")
# torch's kernel, and the batched products of the grouped float32 decode (bfloat16 on the CPU)
ATTENTION = (
    "aten::_scaled_dot_product_flash_attention_for_cpu",
    "aten::bmm",
    "lora_guard::decode_attention",
)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--adapter", help="a demo adapter id (default: the base model)")
    parser.add_argument("--adapters", type=int, default=0, help="cycle over this many demo ones")
    parser.add_argument("--batch", type=int, default=1, help="requests decoding together")
    args = parser.parse_args()
    demo = prepare_demo(log=lambda _msg: None)
    names = sorted(p.name for p in demo.adapter_dir.iterdir() if p.is_dir())[: args.adapters]
    if args.adapter:
        names = [args.adapter]
    adapters = {n: demo.adapter_dir / n for n in names} or None
    llm = LLM(
        demo.model_dir,
        adapters=adapters,
        dtype=args.dtype,
        enable_prefix_caching=False,
        max_num_seqs=max(args.batch, 1),
    )
    prompts = [list(range(100 + i, 140 + i)) for i in range(args.batch)]
    params = SamplingParams(max_new_tokens=args.tokens, ignore_eos=True)
    ids = [names[i % len(names)] if names else None for i in range(args.batch)]
    llm.generate(prompts, params, ids)  # warm-up
    per_step = []
    for _ in range(args.turns):
        started = time.perf_counter()
        llm.generate(prompts, params, ids)
        per_step.append((time.perf_counter() - started) * 1000 / args.tokens)
    ms = statistics.median(per_step)
    runs = ", ".join(f"{t:.1f}" for t in per_step)
    print(
        f"{args.dtype}, batch {args.batch}, {len(names)} adapters: {ms:.1f} ms a step, "
        f"{1000 * args.batch / ms:.1f} tok/s (turns: {runs} ms)"
    )

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        llm.generate(prompts, params, ids)
    events = prof.key_averages()
    linear = sum(e.self_cpu_time_total for e in events if e.key in LINEAR) / 1000
    attention = sum(e.self_cpu_time_total for e in events if e.key in ATTENTION) / 1000
    ops = sum(e.self_cpu_time_total for e in events) / 1000
    calls = sum(e.count for e in events)
    n = args.tokens
    others = (ops - linear - attention) / n
    print(
        f"torch's operations a step ({calls // n} of them), under the profiler: linear layers "
        f"{linear / n:.1f} ms, attention {attention / n:.1f} ms, the others {others:.1f} ms; "
        f"the step time leaves {ms - ops / n:.1f} ms for Python"
    )
    others_top = sorted(
        (e for e in events if e.key not in LINEAR and e.key not in ATTENTION),
        key=lambda e: -e.self_cpu_time_total,
    )[:8]
    print(
        "the others' largest, ms a step (calls): "
        + ", ".join(
            f"{e.key} {e.self_cpu_time_total / 1000 / n:.1f} ({e.count // n})" for e in others_top
        )
    )
    llm.engine.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
