"""The engine with the compiled layer operations and with torch's, in one process, taking turns.

    .venv/bin/python scripts/layer_ops_ab.py --dtype bfloat16 --turns 3

One engine on the demo model (`lora-guard prepare-demo`), prefix caching off. Each turn runs,
with the compiled operations (``layer_ops.cpp``) and then with torch's (``model.fused`` off):
one stream of 64 base-model tokens, and 32 requests over 8 adapters decoding 64 tokens together.
Prints the time a step takes (one token of each request) per turn, and the ratio of the two per
turn: taking turns inside one process keeps a shared machine's drift out of the ratios.
"""

from __future__ import annotations

from ab_turns import arguments, demo_engine, take_turns


def main() -> None:
    args = arguments(__doc__)
    llm, names = demo_engine(args.dtype)
    cases = {
        "one stream, base model": ([list(range(100, 140))], [None]),
        "32 requests over 8 adapters": (
            [list(range(100 + i, 140 + i)) for i in range(32)],
            [names[i % len(names)] for i in range(32)],
        ),
    }
    model = llm.engine.model
    print(f"{args.dtype}, compiled layer operations: {model.fused}")

    def use(fused: bool) -> None:
        model.fused = fused

    take_turns(llm, cases, use, args.turns, ("compiled", "torch's"))
    llm.engine.shutdown()


if __name__ == "__main__":
    main()
