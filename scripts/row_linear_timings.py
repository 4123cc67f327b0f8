"""The row kernel against oneDNN's blocked kernel on the demo model's projections, by rows.

    .venv/bin/python scripts/row_linear_timings.py

For float32 and bfloat16 and 1 to 8 rows of x: the milliseconds one token's 30 x 4 projections
take (random weights of the demo's shapes, each its own tensor, streamed one after another as
the forward does, so the weights come from memory), with oneDNN's blocked kernel and with the
row kernel (``row_linear.cpp``), and the ratio. ``ROW_KERNEL_ROWS`` in ``engine/linear.py``
keeps the row kernel where it is faster.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
from transformers import AutoConfig

from lora_guard.demo.model import prepare_demo
from lora_guard.engine import native
from lora_guard.engine.linear import Linear
from lora_guard.engine.spec import ModelSpec


def ms(run: Callable[[], object], times: int = 9) -> float:
    for _ in range(2):
        run()
    taken = []
    for _ in range(times):
        started = time.perf_counter()
        run()
        taken.append(time.perf_counter() - started)
    return 1000 * statistics.median(taken)


def compare(weights: list[torch.Tensor], blocked: list[Linear], rows: int) -> tuple[float, float]:
    """ms a token's projections take over ``rows`` rows: oneDNN's blocked kernel, the row kernel."""
    dtype, op = weights[0].dtype, torch.ops.lora_guard.row_linear
    xs = {n: torch.randn(rows, n).to(dtype) for n in {w.shape[1] for w in weights}}
    pairs = list(zip(blocked, weights, strict=True))
    return (
        ms(lambda: [p(xs[w.shape[1]]) for p, w in pairs]),
        ms(lambda: [op(xs[w.shape[1]], w, None) for w in weights]),
    )


def main() -> None:
    if not native.load():
        raise SystemExit(f"the compiled operations are not available: {native.error()}")
    demo = prepare_demo(log=lambda _m: None)
    s = ModelSpec.from_config(AutoConfig.from_pretrained(demo.model_dir))
    qkv = (s.num_heads + 2 * s.num_kv_heads) * s.head_dim
    shapes = [
        (qkv, s.hidden_size),
        (s.hidden_size, s.num_heads * s.head_dim),
        (2 * s.intermediate_size, s.hidden_size),
        (s.hidden_size, s.intermediate_size),
    ] * s.num_layers
    print(f"the demo's {len(shapes)} projections a token, two threads; ms with oneDNN's blocked")
    print("kernel, with the row kernel, and their ratio")
    for dtype in (torch.bfloat16, torch.float32):
        torch.manual_seed(0)
        weights = [torch.randn(out, fan_in).to(dtype) * 0.05 for out, fan_in in shapes]
        blocked = [Linear(w, None, blocked=True) for w in weights]
        mb = sum(w.numel() * w.element_size() for w in weights) / 1e6
        for rows in range(1, 9):
            a, b = compare(weights, blocked, rows)
            print(
                f"{str(dtype).removeprefix('torch.')}, {rows} rows ({mb:.0f} MB): blocked "
                f"{a:.2f} ms, row kernel {b:.2f} ms, {b / a:.2f}x"
            )


if __name__ == "__main__":
    main()
