"""The engine with and without the row kernel for decode steps of a few sequences, in one
process, taking turns.

    .venv/bin/python scripts/row_linear_ab.py --dtype bfloat16 --turns 3

One engine on the demo model (`lora-guard prepare-demo`), prefix caching off, its projections
keeping their rows beside oneDNN's blocked layout (the default on a CPU). Each turn runs each
case with the row kernel (``row_linear.cpp``) and then with oneDNN's blocked kernel alone (each
projection's ``row_limit`` set to 0): one stream of base-model tokens, one under an adapter,
then 2, 3 and 32 requests over the demo's adapters, 64 new tokens each. Prints the time a step
takes per turn and the ratio of the two per turn.
"""

from __future__ import annotations

from ab_turns import Case, arguments, demo_engine, take_turns

from lora_guard.engine.linear import Linear


def main() -> None:
    args = arguments(__doc__)
    llm, names = demo_engine(args.dtype)
    model = llm.engine.model
    linears: list[Linear] = [p for layer in model.layers for p in layer.projections.values()]
    if isinstance(model.lm_head, Linear):
        linears.append(model.lm_head)
    limits = [p.row_limit for p in linears]
    print(f"{args.dtype}, rows kept: {model.rows}, row kernel up to {max(limits)} rows")

    def use(rows: bool) -> None:
        for p, limit in zip(linears, limits, strict=True):
            p.row_limit = limit if rows else 0

    def batch(n: int, adapters: bool) -> Case:
        prompts = [list(range(100 + i, 140 + i)) for i in range(n)]
        return prompts, [names[i % len(names)] if adapters else None for i in range(n)]

    cases = {
        "one stream, base model": batch(1, False),
        "one stream, an adapter": batch(1, True),
        "2 requests, 2 adapters": batch(2, True),
        "3 requests, base model": batch(3, False),
        "32 requests over 8 adapters": batch(32, True),
    }
    take_turns(llm, cases, use, args.turns, ("row kernel", "blocked alone"))
    llm.engine.shutdown()


if __name__ == "__main__":
    main()
