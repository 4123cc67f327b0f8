"""How fast this machine runs one fixed piece of work, right now.

On a shared virtual machine the same work can run at very different speeds a minute apart
(docs/benchmarks.md). The capacity sweep measures this just before each of its points, while the
server under test is idle, so a figure taken in a slow spell can be told apart from a slow
system. To watch the machine alone: ``python -m lora_guard.bench.machine_speed --seconds 60``
(``--dtype bfloat16``: in a bfloat16 run's dtype).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Sequence

from lora_guard.clock import timer

# rows x in x out: 64 decode rows through a projection the size of the demo model's MLP gate
SHAPE = (64, 576, 1536)


def machine_speed(seconds: float = 0.5, dtype: str = "float32") -> float:
    """GFLOP/s of matrix products of :data:`SHAPE` in ``dtype`` (a torch dtype's name), run back
    to back for ``seconds`` on every thread torch uses."""
    import torch

    rows, inner, cols = SHAPE
    kind = getattr(torch, dtype)
    a, b = torch.randn(rows, inner, dtype=kind), torch.randn(inner, cols, dtype=kind)
    torch.mm(a, b)  # not timed: the first call builds the kernel
    products = 0
    start = timer()
    while (elapsed := timer() - start) < seconds:
        torch.mm(a, b)
        products += 1
    return 2 * rows * inner * cols * products / elapsed / 1e9


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m lora_guard.bench.machine_speed",
        description="Print this machine's speed on a fixed matrix product, once a second.",
    )
    parser.add_argument("--seconds", type=int, default=60, help="how long to watch")
    parser.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        default="float32",
        help="of the products",
    )
    args = parser.parse_args(argv)
    if args.seconds < 1:
        parser.error("--seconds must be at least 1")
    speeds = []
    for second in range(args.seconds):
        speeds.append(machine_speed(1.0, args.dtype))
        print(f"{second + 1:4d} s  {speeds[-1]:7.1f} GFLOP/s", flush=True)
    low, high = min(speeds), max(speeds)
    print(
        f"min {low:.1f}, median {statistics.median(speeds):.1f}, max {high:.1f} GFLOP/s "
        f"(max/min {high / low:.2f})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
