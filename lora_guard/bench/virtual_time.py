"""``python -m lora_guard.bench.virtual_time``: the bench's workload through the real engine and
its policies, on a clock that each step's modelled cost moves.

A wall-clock replay on a shared machine measures the machine as much as the policies. Here the real
engine (scheduler, residency, cache pool, policies, a tiny model's forward) runs every step as fast
as it can, and the engine's clock (the ``clock`` it is given, which every policy, the heat and
load windows and the residency quantum read) advances by what that step would cost under a cost
profile (``--profile``, ``cost_profiles``: a fixed part, a part per sequence, per MiB of adapter
weights the batch reads and per prompt token, plus each adapter written into the pool, per MiB).
A read from disk runs beside the steps, one at a time as the loader thread reads, and lands once
its modelled time (fixed + per MiB) has passed on the clock. The tiny model has the profile
model's proportions, scaled down, so an adapter's pages and a token's KV keep the real model's
ratio; bytes are counted as the same adapter (rank, targets) or KV takes on the profile's model.
A request a policy turns away (429) is sent again after its retry-after, as a client would.
Arrivals are replayed on that clock, at ``--load`` of the capacity measured the same way (the
bench's capacity run, on the base model). The same command gives the same figures on any machine,
busy or not; what it cannot show is a real cost the model leaves out.

    python -m lora_guard.bench.virtual_time --scenario pressure --profile a10-7b --seeds 0,1,2
"""

from __future__ import annotations

import argparse
import json
import tempfile
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from functools import partial
from pathlib import Path

from lora_guard.bench.virtual.schemes import (
    SCHEMES,
    Bench,
)
from lora_guard.bench.virtual.study import (
    SEED_SCHEMES,
    print_report,
    print_seed_table,
    report,
    seed_table,
    study,
)
from lora_guard.config import add_engine_flags
from lora_guard.cost_profiles import PROFILES, Profile, profile, profiles_help
from lora_guard.policies.hot_set import MAX_ADAPTER_WAIT_S
from lora_guard.simulate_costs import Costs, read_costs
from lora_guard.workload.scenarios import scenario
from lora_guard.workload.spec import PROMPT_WORDS
from lora_guard.workload.trace import (
    SCENARIOS,
    TraceError,
    WorkloadSpec,
    read_trace,
)

PRESSURE_RANKS = (8, 16, 32, 64)  # with targets alternating: 21x in bytes from least to most


def trace_ranks(path: Path) -> dict[str, int]:
    """Each adapter a JSONL trace names, with its rank: the line's ``rank`` field, else the
    ranks of :data:`PRESSURE_RANKS` in turn."""
    ranks: dict[str, int] = {}
    with path.open() as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            data = json.loads(line)
            adapter = data.get("adapter_id")
            if adapter is None:
                continue
            if not isinstance(adapter, str) or not adapter or Path(adapter).name != adapter:
                raise TraceError(f"{path}:{number}: adapter_id must be a plain name: {adapter!r}")
            rank = data.get("rank", PRESSURE_RANKS[len(ranks) % len(PRESSURE_RANKS)])
            if not isinstance(rank, int) or not 1 <= rank <= 64:
                raise TraceError(f"{path}:{number}: rank must be a whole number 1-64: {rank!r}")
            ranks.setdefault(adapter, rank)
    return ranks


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m lora_guard.bench.virtual_time",
        description="The bench workload through the real engine and policies on a virtual clock.",
    )
    add = parser.add_argument
    add(
        "--schemes",
        help=f"comma-separated, of {', '.join(SCHEMES)} (default: base,lru,lora-guard; seed: "
        f"{','.join(SEED_SCHEMES)})",
    )
    add(
        "--scenario",
        choices=SCENARIOS,
        default="zipf",
        help="; ".join(f"{s.name}: {s.about}" for s in SCENARIOS.values())
        + "; pressure and public run 1000 requests in a pool sized by the load (default: zipf)",
    )
    add(
        "--trace",
        type=Path,
        help="replay this JSONL trace (the bench's format; adapters it names "
        "are made for the tiny model, ranks from an optional 'rank' field)",
    )
    # The engine's flags as `lora-guard serve` has them. Without --cache-memory the pool is sized
    # here, by the scenario (not a quarter of free memory): the figures depend on no machine.
    add_engine_flags(
        parser,
        ["max_loras", "cache_memory"],
        shown={
            "cache_memory": "the profile's memory for KV and adapters, in its model's bytes; "
            "pressure and public: sized so the adapters in use over a minute take 3x the room "
            "beside the KV the load needs"
        },
    )
    add(
        "--max-adapter-wait-s",
        type=float,
        help="lora-guard's hot-set: a request waiting this long goes ahead of all others and "
        f"may displace any adapter (default {MAX_ADAPTER_WAIT_S}, as served)",
    )
    add("--seeds", default=None, help="comma-separated trace seeds (default: 0)")
    add("--seed", type=int, help="one seed: --seeds N")
    add("--requests", type=int, help="requests per seed (default 200; pressure, public: 1000)")
    add("--adapters", type=int, help="adapters (default 24; pressure: 200; public: 229)")
    add("--tenants", type=int, help="tenants (default 6; pressure, public: 8)")
    add("--load", type=float, default=0.7, help="share of the capacity")
    add("--output-mean", type=float, help="mean output tokens (default 64; seed: 180)")
    add(
        "--profile",
        choices=PROFILES,
        default="cpu-demo",
        help=f"the model's shape, memory and costs (docs/simulate.md): {profiles_help()}",
    )
    add("--costs", type=Path, help="costs JSON (simulate --calibrate), over the profile's")
    add("--json", type=Path, help="write the figures here")
    add(
        "--bound",
        action="store_true",
        help="also the TTFT p95 no schedule of each seed's trace gets under on its pool: a "
        "linear relaxation solved with HiGHS (the bench extra; virtual/bound.py)",
    )
    add("--jobs", type=int, default=1, help="seeds replayed at once, each in its own process")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    default = ",".join(SEED_SCHEMES) if args.scenario == "seed" else "base,lru,lora-guard"
    schemes = [s for s in (args.schemes or default).split(",") if s]
    unknown = [s for s in schemes if s not in SCHEMES]
    if unknown:
        parser.error(f"unknown scheme {unknown[0]!r}; choose from {', '.join(SCHEMES)}")
    seeds = _seeds(parser, args)
    if args.max_adapter_wait_s is not None and not args.max_adapter_wait_s > 0:
        parser.error(f"--max-adapter-wait-s takes seconds > 0, got {args.max_adapter_wait_s}")
    cache_memory = args.cache_memory  # bytes, or None
    spec = _spec(args)
    chosen = profile(args.profile)
    costs = read_costs(args.costs) if args.costs else chosen.costs
    with tempfile.TemporaryDirectory() as tmp:
        bench = _make_bench(Path(tmp), spec, args, chosen, costs)
        trace = read_trace(args.trace) if args.trace else None
        specs = [replace(spec, seed=seed) for seed in (seeds if trace is None else [seeds[0]])]
        work = partial(
            study,
            bench,
            schemes=schemes,
            load=args.load,
            trace=trace,
            cache_memory=cache_memory,
            bound=args.bound,
        )
        if args.jobs > 1 and len(specs) > 1:
            # one process a seed (the figures are the same: each replay runs on its own clock)
            jobs = min(args.jobs, len(specs))
            with ProcessPoolExecutor(jobs, initializer=_one_thread) as workers:
                runs = list(workers.map(work, specs))
        else:
            runs = [work(s) for s in specs]
    out = report(runs, schemes)
    describe = None if args.trace else scenario(spec.scenario).describe
    if describe is not None and runs[0].rate is not None:
        print(f"{spec.scenario} workload: {describe(replace(spec, rate=runs[0].rate))}")
    out = {
        "scenario": "trace" if args.trace else spec.scenario,
        "seeds": None if args.trace else seeds,
        "requests": spec.requests,
        "max_loras": args.max_loras,
        "load": args.load,
        "profile": chosen.name,
        "model": chosen.shape.model,
        "bytes_scale": bench.scale,
        "costs": costs.source,
        "max_adapter_wait_s": args.max_adapter_wait_s or MAX_ADAPTER_WAIT_S,
        **out,
    }
    print_report(out, runs)
    if spec.scenario == "seed":
        out["seed_table"] = seed_table(out["schemes"], chosen)
        print_seed_table(out["seed_table"])
    if args.json:
        args.json.write_text(json.dumps(out, indent=2) + "\n")
    return 0


def _one_thread() -> None:
    import torch

    torch.set_num_threads(1)


def _seeds(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[int]:
    if args.seeds is not None and args.seed is not None:
        parser.error("give --seeds or --seed, not both")
    if args.seed is not None:
        return [args.seed]
    try:
        seeds = [int(s) for s in (args.seeds or "0").split(",") if s.strip()]
    except ValueError:
        parser.error(f"--seeds takes whole numbers such as 0,1,2, got {args.seeds!r}")
    if not seeds or len(set(seeds)) != len(seeds):
        parser.error(f"--seeds takes distinct whole numbers such as 0,1,2, got {args.seeds!r}")
    return seeds


def _spec(args: argparse.Namespace) -> WorkloadSpec:
    given = {
        k: v
        for k, v in (
            ("adapters", args.adapters),
            ("tenants", args.tenants),
            ("requests", args.requests),
        )
        if v is not None
    }
    chosen = scenario(args.scenario)
    spec = WorkloadSpec(
        requests=chosen.requests, output_mean=args.output_mean or chosen.output_mean
    )
    return chosen.apply(spec, **given)


def _make_bench(
    tmp: Path, spec: WorkloadSpec, args: argparse.Namespace, chosen: Profile, costs: Costs
) -> Bench:
    """A tiny model of the profile's proportions and the study's adapters: mixed ranks and
    targets for ``pressure``, ``public`` and a trace, ranks 4-16 on every projection otherwise."""
    from lora_guard.demo.adapters import make_adapters, named_specs, write_adapters

    model = tiny_model(tmp / "model", chosen)
    out = tmp / "adapters"
    if args.trace:
        folders = write_adapters(model, out, named_specs(trace_ranks(args.trace)), strength=0.5)
    elif scenario(spec.scenario).mixed_adapters:
        folders = make_adapters(
            model, out, n=spec.adapters, ranks=PRESSURE_RANKS, prefix="demo", strength=0.5
        )
    else:
        ranks = scenario(spec.scenario).ranks
        folders = make_adapters(
            model, out, n=spec.adapters, ranks=ranks, prefix="demo", all_projections=True
        )
    sizes = {f.name: weight_bytes(f) for f in folders}
    ids = [f.name for f in folders]
    settings = {}
    if args.max_adapter_wait_s is not None:
        settings["max_adapter_wait_s"] = args.max_adapter_wait_s
    scale = chosen.shape.scale(model)
    return Bench(model, out, ids, chosen, costs, args.max_loras, scale, sizes, settings)


def tiny_model(out: Path, chosen: Profile) -> Path:
    """A random model of the profile's proportions whose tokenizer learnt the words the bench's
    prompts are made of, so a prompt takes about as many tokens as on a real model."""
    from lora_guard.demo.testing import make_tiny_llama

    config = chosen.shape.tiny_config()
    return make_tiny_llama(
        out, max_position_embeddings=4096, tokenizer_words=PROMPT_WORDS, **config
    )


def weight_bytes(folder: Path) -> int:
    """The tensor bytes of an adapter's safetensors files (their headers left out)."""
    total = 0
    for path in folder.glob("*.safetensors"):
        with path.open("rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        total += sum(
            end - start
            for k, v in header.items()
            if k != "__metadata__"
            for start, end in [v["data_offsets"]]
        )
    return total


if __name__ == "__main__":
    raise SystemExit(main())
