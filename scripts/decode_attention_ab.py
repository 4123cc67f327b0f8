"""A bfloat16 model's decode attention on the CPU: the engine's grouped float32 path against
torch's attention kernel, in one process, taking turns.

    .venv/bin/python scripts/decode_attention_ab.py --turns 6

The demo model in bfloat16 with its 8 adapters, at most 32 sequences a step, prefix caching off;
each turn serves the next 64 requests of the bench's default trace (`lora-guard bench`'s
prompts: a tenant's system prompt and a question; `--output-mean` new tokens on average) with
one of the two decode paths, the order alternating pair by pair, so a shared machine's drift
falls on both.
Prints each turn's tokens/s and median decode-only step, then each pair's ratio; first, one
layer's decode attention alone for 32 sequences of 140 positions, each path in bfloat16 and
torch's kernel in float32.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
from torch.nn.attention import sdpa_kernel

from lora_guard import LLM, SamplingParams
from lora_guard.bench.arguments import add_arguments, workload_spec
from lora_guard.demo.model import prepare_demo
from lora_guard.engine.model import ATTENTION_BACKENDS
from lora_guard.workload.trace import make_trace

CHUNK = 64


def one_layer(model: Any, batch: int = 32, ctx: int = 140, calls: int = 50) -> None:
    """Microseconds a call of each decode path takes on one layer's shapes."""
    spec = model.spec
    torch.manual_seed(0)
    q = torch.randn(batch, spec.num_heads, spec.head_dim)
    k = torch.randn(batch, ctx, spec.num_kv_heads, spec.head_dim)
    v = torch.randn(batch, ctx, spec.num_kv_heads, spec.head_dim)
    mask = torch.arange(ctx)[None, :] < torch.randint(ctx // 2, ctx + 1, (batch,))[:, None]

    def timed(path: Any, dtype: torch.dtype) -> float:
        args = (q.to(dtype), k.to(dtype), v.to(dtype), mask)
        with sdpa_kernel(ATTENTION_BACKENDS):
            path(*args)
            started = time.perf_counter()
            for _ in range(calls):
                path(*args)
        return (time.perf_counter() - started) / calls * 1e6

    bf16 = torch.bfloat16
    print(
        f"one layer, {batch} sequences of {ctx} positions: grouped float32 "
        f"{timed(model._grouped_decode, bf16):.0f} us, torch's kernel in bfloat16 "
        f"{timed(model._torch_decode, bf16):.0f} us, in float32 "
        f"{timed(model._torch_decode, torch.float32):.0f} us"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--turns", type=int, default=6, help="an even number: pairs of turns")
    parser.add_argument("--output-mean", help="new tokens on average (the bench's default)")
    args = parser.parse_args()
    demo = prepare_demo(log=lambda _msg: None)
    ids = sorted(p.name for p in demo.adapter_dir.iterdir() if p.is_dir())[:8]
    bench = argparse.ArgumentParser()
    add_arguments(bench)
    flags = ["--adapters", "8", "--requests", str(CHUNK * args.turns)]
    if args.output_mean:
        flags += ["--output-mean", args.output_mean]
    spec = workload_spec(bench.parse_args(flags))
    trace = make_trace(spec, ids)
    llm = LLM(
        demo.model_dir,
        adapters={i: demo.adapter_dir / i for i in ids},
        dtype="bfloat16",
        max_loras=8,
        max_num_seqs=32,
        enable_prefix_caching=False,
    )
    model = llm.engine.model
    grouped = model._grouped_decode
    one_layer(model)

    rates: dict[str, list[float]] = {"grouped": [], "torch": []}
    for turn in range(args.turns):
        pair, second = divmod(turn, 2)
        name = ("grouped", "torch")[second ^ (pair % 2)]
        model._grouped_decode = grouped if name == "grouped" else model._torch_decode  # type: ignore[method-assign]
        part = trace[turn * CHUNK : (turn + 1) * CHUNK]
        params = [SamplingParams(max_new_tokens=r.max_new_tokens, ignore_eos=True) for r in part]
        steps_before = llm.engine.stats.steps
        started = time.perf_counter()
        outs = llm.generate([r.prompt for r in part], params, [r.adapter_id for r in part])
        seconds = time.perf_counter() - started
        steps = list(llm.engine.stats.recent_steps)[-(llm.engine.stats.steps - steps_before) :]
        decode = [s.seconds for s in steps if s.prefill_tokens == 0 and s.seqs >= 16]
        rates[name].append(sum(len(o.token_ids) for o in outs) / seconds)
        step_ms = 1000 * statistics.median(decode) if decode else float("nan")
        print(f"turn {turn}: {name}, {rates[name][-1]:.1f} tok/s, decode step {step_ms:.1f} ms")
    ratios = [g / t for g, t in zip(rates["grouped"], rates["torch"], strict=True)]
    print(
        "grouped / torch tok/s, each pair: "
        + ", ".join(f"{r:.2f}x" for r in ratios)
        + f" (median {statistics.median(ratios):.2f}x)"
    )
    llm.engine.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
