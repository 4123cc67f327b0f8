"""What the engine A/B scripts share: the demo model's engine, prefix cache off, and one case
after another run both ways in turns inside one process (a shared machine's drift then falls on
both alike), the step time per turn and the ratio of the two per turn printed."""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

from lora_guard import LLM, SamplingParams
from lora_guard.demo.model import prepare_demo

TOKENS = 64  # new tokens a request
Case = tuple[list[list[int]], list[str | None]]  # prompts and their adapters


def arguments(doc: str) -> argparse.Namespace:
    """The scripts' flags: ``--dtype`` (default bfloat16) and ``--turns`` (default 3)."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--turns", type=int, default=3)
    return parser.parse_args()


def demo_engine(dtype: str) -> tuple[LLM, list[str]]:
    """The demo model in ``dtype`` with its first 8 adapters (their names), prefix cache off."""
    demo = prepare_demo(log=lambda _msg: None)
    names = sorted(p.name for p in demo.adapter_dir.iterdir() if p.is_dir())[:8]
    llm = LLM(
        demo.model_dir,
        adapters={n: demo.adapter_dir / n for n in names},
        dtype=dtype,
        enable_prefix_caching=False,
        max_num_seqs=32,
    )
    return llm, names


def take_turns(
    llm: LLM, cases: dict[str, Case], use: Callable[[bool], None], turns: int, ways: tuple[str, str]
) -> None:
    """Each case, ``turns`` times with ``use(True)`` then ``use(False)`` (named ``ways``): the
    step time (one token of each request) per turn and the first over the second per turn."""
    params = SamplingParams(max_new_tokens=TOKENS, ignore_eos=True)
    for case, (prompts, ids) in cases.items():
        llm.generate(prompts, params, ids)  # warm-up
        steps: dict[bool, list[float]] = {True: [], False: []}
        for _ in range(turns):
            for on in (True, False):
                use(on)
                started = time.perf_counter()
                llm.generate(prompts, params, ids)
                steps[on].append((time.perf_counter() - started) * 1000 / TOKENS)
        use(True)
        ratios = [a / b for a, b in zip(steps[True], steps[False], strict=True)]
        each = {on: ", ".join(f"{v:.1f}" for v in steps[on]) for on in (True, False)}
        print(
            f"{case}: {ways[0]} {statistics.median(steps[True]):.1f} ms a step ({each[True]}), "
            f"{ways[1]} {statistics.median(steps[False]):.1f} ({each[False]}); step time "
            f"{ways[0]} / {ways[1]} per turn {', '.join(f'{r:.3f}' for r in ratios)}, "
            f"median {statistics.median(ratios):.3f}"
        )
