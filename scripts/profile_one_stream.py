"""Where one stream's time goes in the engine: the demo model, one request, token by token.

    .venv/bin/python scripts/profile_one_stream.py --dtype bfloat16 --turns 3

Runs one request of 64 new tokens (after a warm-up), `--turns` times, and prints the time a
token takes; then one more under torch's profiler, with the self time of torch's operations a
token split into the base model's linear layers (the weight bytes every step reads), attention
and every other operation. What the token time leaves over is Python (the forward's glue, the
scheduler, sampling). With `--adapter ID`, the request runs under that demo adapter.
"""

from __future__ import annotations

import argparse
import statistics
import time

from torch.profiler import ProfilerActivity, profile

from lora_guard import LLM, SamplingParams
from lora_guard.demo.model import prepare_demo

LINEAR = ("mkldnn::_linear_pointwise", "aten::addmm", "aten::mm", "aten::linear", "aten::matmul")
ATTENTION = ("aten::_scaled_dot_product_flash_attention_for_cpu",)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--adapter", help="a demo adapter id (default: the base model)")
    args = parser.parse_args()
    demo = prepare_demo(log=lambda _msg: None)
    adapters = {args.adapter: demo.adapter_dir / args.adapter} if args.adapter else None
    llm = LLM(demo.model_dir, adapters=adapters, dtype=args.dtype, enable_prefix_caching=False)
    prompt = list(range(100, 140))
    params = SamplingParams(max_new_tokens=args.tokens, ignore_eos=True)
    ids = [args.adapter]
    llm.generate([prompt], params, ids)  # warm-up
    per_token = []
    for _ in range(args.turns):
        started = time.perf_counter()
        llm.generate([prompt], params, ids)
        per_token.append((time.perf_counter() - started) * 1000 / args.tokens)
    ms = statistics.median(per_token)
    runs = ", ".join(f"{t:.1f}" for t in per_token)
    print(f"{args.dtype}: {ms:.1f} ms a token, {1000 / ms:.1f} tok/s (turns: {runs} ms)")

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        llm.generate([prompt], params, ids)
    events = prof.key_averages()
    linear = sum(e.self_cpu_time_total for e in events if e.key in LINEAR) / 1000
    attention = sum(e.self_cpu_time_total for e in events if e.key in ATTENTION) / 1000
    ops = sum(e.self_cpu_time_total for e in events) / 1000
    calls = sum(e.count for e in events)
    n = args.tokens
    others = (ops - linear - attention) / n
    print(
        f"torch's operations a token ({calls // n} of them), under the profiler: linear layers "
        f"{linear / n:.1f} ms, attention {attention / n:.1f} ms, the others {others:.1f} ms; "
        f"the token time leaves {ms - ops / n:.1f} ms for Python"
    )
    llm.engine.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
