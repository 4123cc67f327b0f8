"""Microseconds a call of the compiled layer operations takes, on shapes of the demo model.

    .venv/bin/python scripts/layer_op_timings.py

Decode attention for 3 KV heads of 3 query heads each, 64 dimensions, bfloat16 (one sequence of
100 and of 300 positions, 32 of 100), then a norm with its residual and SiLU of one row. Each
call reads the same slots, so the cache is warm: in a step each layer reads its own keys and
values from memory. Run it on two commits to compare them.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from lora_guard.engine import native

KV_HEADS, HEADS, HEAD_DIM, SLOTS = 3, 9, 64, 60_000


def per_call_us(fn: Callable[[], object], calls: int) -> float:
    for _ in range(20):
        fn()
    started = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - started) / calls * 1e6


def main() -> None:
    if not native.load():
        raise SystemExit(f"the compiled operations cannot be built here: {native.error()}")
    ops = torch.ops.lora_guard
    torch.manual_seed(0)
    k_cache = torch.randn(SLOTS, KV_HEADS, HEAD_DIM).bfloat16()
    v_cache = torch.randn(SLOTS, KV_HEADS, HEAD_DIM).bfloat16()
    print(f"torch threads: {torch.get_num_threads()}")
    for batch, ctx, calls in ((1, 100, 3000), (1, 300, 2000), (32, 100, 200)):
        slots = torch.stack([torch.arange(ctx) + b * 1000 for b in range(batch)])
        args = (torch.randn(batch, HEADS, HEAD_DIM).bfloat16(), k_cache, v_cache, slots)
        lengths = torch.full((batch,), ctx)
        us = per_call_us(lambda a=args, n=lengths: ops.decode_attention(*a, n, 0.125), calls)
        print(f"decode_attention, {batch} x {ctx} positions: {us:.1f} us")
    x, delta = torch.randn(1, 576).bfloat16(), torch.zeros(1, 576).bfloat16()
    weight, gate_up = torch.randn(576).bfloat16(), torch.randn(1, 2 * 1536).bfloat16()
    norm = per_call_us(lambda: ops.add_rms_norm(x, delta, weight, 1e-5), 20000)
    print(f"add_rms_norm, 576: {norm:.1f} us")
    print(f"silu_mul, 1536: {per_call_us(lambda: ops.silu_mul(gate_up), 20000):.1f} us")


if __name__ == "__main__":
    main()
