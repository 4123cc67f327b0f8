"""``lora-guard bench``: replay one multi-adapter trace against each scheme and print the table.

Each scheme runs in a fresh process, one after another, so that its memory peak is its own and
no state carries over. Replay ``i`` (over the seeds, and ``--turns`` per seed) runs the schemes in
the order given rotated by ``i``, so no scheme always replays first: this machine's speed drifts
between replays minutes apart, and a fixed order hands the drift to the same scheme every time.
Then the oracle (each request's greedy tokens, alone) is computed, and every scheme's outputs are
compared with it.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from statistics import median_low
from typing import Any

import httpx

from lora_guard.bench.arguments import (
    SCHEMES,
    model_and_spec,
    seeds_of,
    trace_of,
    workload_spec,
)
from lora_guard.bench.capacity import (
    CAPACITY_BATCH,
    Capacity,
    arrival_rate,
    capacity_prompts,
    measure_capacity,
)
from lora_guard.bench.compass import compass, compass_lines
from lora_guard.bench.isolate import call_in_process
from lora_guard.bench.oracle import oracle_mismatches, target_mismatches
from lora_guard.bench.peer_env import PeerError
from lora_guard.bench.peft_peer import replay_peft
from lora_guard.bench.replay import (
    EngineOptions,
    SchemeRun,
    adapter_ids,
    replay_scheme,
)
from lora_guard.bench.report import aggregate, markdown_table, summarize
from lora_guard.bench.target import replay_target
from lora_guard.bench.vllm_peer import peer_python, replay_vllm
from lora_guard.clock import monotonic
from lora_guard.config import engine_names
from lora_guard.workload.stats import describe_trace, median, trace_summary
from lora_guard.workload.trace import (
    TraceError,
    TraceRequest,
    WorkloadSpec,
)


def run(args: argparse.Namespace, argv: Sequence[str]) -> int:
    # Each scheme and peer (torch, PEFT, vLLM) is handed the device and dtype by name: auto's, too.
    args.device, args.dtype = engine_names(args.device, args.dtype)
    if args.sweep:
        from lora_guard.bench import sweep

        return sweep.run(args, argv)
    started = monotonic()
    schemes = [s.strip() for s in args.schemes.split(",") if s.strip()]
    problem = _check(args, schemes)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="lora-guard-bench-") as scratch:
        try:
            if args.target:
                bench = _against_target(args, started)
            else:
                bench = _in_process(args, schemes, Path(scratch), started)
        except (TraceError, PeerError, OSError, httpx.HTTPError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    per_seed = [_summaries(part) for part in bench.parts]
    summaries = aggregate(per_seed)
    targets = compass(per_seed)
    print(markdown_table(summaries))
    seeds = list(dict.fromkeys(part.seed for part in bench.parts))
    turns = len(per_seed) // len(seeds)
    if len(per_seed) > 1:
        runs = ", ".join(
            f"{part.seed}" + (f"/{part.turn}" if turns > 1 else "") for part in bench.parts
        )
        what = "seed/turn" if turns > 1 else "seeds"
        print(f"\nmedians over {len(per_seed)} runs ({what} {runs}); the JSON has each spread")
    print("\n" + "\n".join(compass_lines(targets, len(seeds), turns)))
    report = {
        "command": "lora-guard " + " ".join(argv),
        "workload": _workloads(bench, args),
        "engine": bench.engine,
        "schemes": summaries,
        "compass": targets,
        "per_seed": [
            {
                "seed": part.seed,
                "turn": part.turn,
                "order": part.order,
                "workload": trace_summary(part.trace),
                "schemes": one,
                # how each peer was started (command line, environment) and its log
                "peers": {name: run.peer for name, run in part.runs.items() if run.peer},
            }
            for part, one in zip(bench.parts, per_seed, strict=True)
        ],
        "duration_s": monotonic() - started,
    }
    _write(args, report, bench, summaries)
    lost = sum(s["requests"] - s["completed"] for s in summaries.values())
    if lost:
        print(f"{lost} requests did not complete (see 'failed' in the JSON)", file=sys.stderr)
    return 1 if lost else 0


def _check(args: argparse.Namespace, schemes: list[str]) -> str | None:
    """What is wrong with the command's schemes and flags, if anything."""
    unknown = [s for s in schemes if s not in SCHEMES]
    if unknown or not schemes:
        name = unknown[0] if unknown else ""
        return f"unknown scheme {name!r}; choose from {', '.join(SCHEMES)}"
    if not args.load > 0:
        return f"--load must be positive, got {args.load}"
    if args.target and args.turns > 1:
        return "--turns replays the schemes run here; a --target run is one scheme"
    return None


def _write(
    args: argparse.Namespace,
    report: dict[str, Any],
    bench: Bench,
    summaries: dict[str, dict[str, Any]],
) -> None:
    """The JSON with each peer's log beside it, and the plots."""
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        for part in bench.parts:  # each peer's log beside the JSON too, to read as it was
            for name, run in part.runs.items():
                if run.peer:
                    log = args.json.with_name(
                        f"{args.json.stem}.{name}-{part.seed}-{part.turn}.log"
                    )
                    log.write_text(run.peer["log"])
    if args.plots:
        from lora_guard.bench.plots import write_plots

        # The CDFs and the hit rate over time are the first seed's runs.
        for path in write_plots(summaries, bench.parts[0].runs, args.plots):
            print(f"wrote {path}", file=sys.stderr)


def _summaries(part: SeedRun) -> dict[str, dict[str, Any]]:
    seeds = None if part.seed is None else [part.seed]
    adapters = trace_summary(part.trace)["adapters"]
    static = part.runs.get("static")
    return {
        name: summarize(run, part.mismatches.get(name), static, seeds, adapters)
        for name, run in part.runs.items()
    }


@dataclass
class SeedRun:
    """Every scheme's replay of one trace, and the requests whose outputs differ from the oracle."""

    seed: int | None  # None: a trace read from a file
    trace: list[TraceRequest]
    runs: dict[str, SchemeRun]
    mismatches: dict[str, int]
    turn: int = 0  # which of the seed's ``--turns``
    order: list[str] = field(default_factory=list)  # the order the schemes replayed in


def replay_order(schemes: Sequence[str], replay: int) -> list[str]:
    """The schemes in the order replay number ``replay`` runs them: rotated by ``replay``."""
    shift = replay % len(schemes) if schemes else 0
    return [*schemes[shift:], *schemes[:shift]]


@dataclass
class Bench:
    parts: list[SeedRun]
    engine: dict[str, Any]
    rate: float  # arrivals per second outside bursts (None for a trace read from a file)
    capacity: Capacity | None = None


def _in_process(
    args: argparse.Namespace, schemes: list[str], scratch: Path, started: float
) -> Bench:
    model, adapter_dir, spec = model_and_spec(args, scratch)
    ids = adapter_ids(adapter_dir)
    options = EngineOptions(
        model=str(model),
        adapter_dir=str(adapter_dir),
        max_loras=args.max_loras if not args.quick else 4,
        max_lora_rank=args.max_lora_rank,
        kv_cache_memory=args.kv_cache_memory if not args.quick else "16MiB",
        dtype=args.dtype,
        lora_dtype=args.lora_dtype,
        device=args.device,
    )
    # --quick runs everything here: process start-up would outweigh the tiny model's work.
    isolated = not args.quick
    spec, capacity = _rate(args, spec, ids, options, isolated, started)
    parts: list[SeedRun] = []
    engine: dict[str, Any] = {}
    peers: dict[str, Path] = {}  # a peer's name: the interpreter that runs it
    for name in args.peer:  # every vLLM peer: one interpreter
        peers[name] = peer_python(args.peer_python, log=lambda msg: _progress(started, msg))
    for seed in seeds_of(args):
        trace = trace_of(args, spec if seed is None else replace(spec, seed=seed), ids, seed)
        used = {r.adapter_id for r in trace if r.adapter_id}
        budget = args.cold_loads_per_minute or max(len(used), 1)
        seed_options = replace(options, cold_loads_per_minute=budget)
        popular = Counter(r.adapter_id for r in trace if r.adapter_id).most_common(1)
        static_id = popular[0][0] if popular else ids[0]
        what = "" if seed is None else f"seed {seed}: "
        seats = f"{options.max_loras} seats" if options.max_loras else "no seat cap"
        _progress(started, f"{what}{describe_trace(trace)}; {seats}; static serves {static_id}")
        turns: list[SeedRun] = []
        for turn in range(args.turns):
            # the peer takes its turn in the rotation like every scheme
            order = replay_order([*schemes, *peers], len(parts) + turn)
            which = f"{what}turn {turn + 1} of {args.turns}: " if args.turns > 1 else what
            runs: dict[str, SchemeRun] = {}
            for scheme in order:
                _progress(started, f"{which}replaying {len(trace)} requests on {scheme}")
                runs[scheme] = _replay(scheme, trace, seed_options, static_id, peers, args, scratch)
            runs = {name: runs[name] for name in [*schemes, *peers]}
            turns.append(SeedRun(seed, trace, runs, {}, turn, order))
        _progress(started, f"{what}computing the oracle")
        mismatches = oracle_mismatches(
            [t.runs for t in turns], trace, seed_options, static_id, isolated
        )
        for one, found in zip(turns, mismatches, strict=True):
            one.mismatches = found
        parts.extend(turns)
        # Folder names, not paths: the report is meant to be shared.
        engine = asdict(seed_options) | {
            "model": Path(options.model).name,
            "adapter_dir": Path(options.adapter_dir).name,
            "static_adapter": static_id,
        }
    _progress(started, "done")
    return Bench(parts, engine, spec.rate, capacity)


def _rate(
    args: argparse.Namespace,
    spec: WorkloadSpec,
    ids: list[str],
    options: EngineOptions,
    isolated: bool,
    started: float,
) -> tuple[WorkloadSpec, Capacity | None]:
    """``spec`` at its arrival rate: ``--rate``, the trace's own, or ``--load`` of the capacity
    measured here (and that capacity)."""
    if args.rate is not None:
        return replace(spec, rate=args.rate), None
    if args.trace:
        return spec, None
    _progress(started, f"measuring capacity: {CAPACITY_BATCH} base-model requests at once")
    capacity = call_in_process(isolated, measure_capacity, capacity_prompts(spec, ids), options)
    spec = replace(spec, rate=arrival_rate(spec, args.load, capacity))
    _progress(
        started,
        f"capacity {capacity.requests_per_s:.3g} requests/s "
        f"({capacity.tokens_per_s:.0f} tokens/s); load {args.load}: "
        f"{spec.rate:.3g} arrivals/s outside bursts",
    )
    return spec, capacity


def _replay(
    scheme: str,
    trace: list[TraceRequest],
    options: EngineOptions,
    static_id: str,
    peers: dict[str, Path],
    args: argparse.Namespace,
    scratch: Path,
) -> SchemeRun:
    """One scheme, PEFT or a vLLM peer replaying ``trace``."""
    isolated = not args.quick
    if scheme == "peft":
        return call_in_process(isolated, replay_peft, trace, options)
    if scheme in peers:
        log = scratch / f"{scheme}.log"
        return replay_vllm(trace, options, peers[scheme], args.peer_port, log, peer=scheme)
    return call_in_process(isolated, replay_scheme, scheme, trace, options, static_id)


def _against_target(args: argparse.Namespace, started: float) -> Bench:
    """A run against the server at ``--target`` per seed; outputs are checked against the oracle
    when ``--model`` (and ``--adapter-dir``) name the checkpoint that server serves."""
    with httpx.Client(base_url=args.target.rstrip("/"), timeout=30) as client:
        listed = client.get("/v1/models").json()["data"]
        base = client.get("/info").json()["model_id"]
    ids = sorted(m["id"] for m in listed if m["id"] != base)
    spec = workload_spec(args)
    spec = replace(spec, rate=args.rate if args.rate is not None else WorkloadSpec().rate)
    parts = []
    for seed in seeds_of(args):
        trace = trace_of(args, spec if seed is None else replace(spec, seed=seed), ids, seed)
        _progress(started, f"{describe_trace(trace)}; against {args.target}")
        run = replay_target(args.target, trace, args.max_loras, args.target_name, args.api_key)
        mismatches: dict[str, int] = {}
        if args.model is not None:
            _progress(started, "computing the oracle")
            options = EngineOptions(
                model=str(args.model),
                adapter_dir=str(args.adapter_dir),
                kv_cache_memory=args.kv_cache_memory,
                dtype=args.dtype,
                lora_dtype=args.lora_dtype,
                device=args.device,
            )
            mismatches[run.scheme] = target_mismatches(run, trace, options)
        parts.append(SeedRun(seed, trace, {run.scheme: run}, mismatches))
    _progress(started, "done")
    return Bench(parts, {"target": args.target, "slots": args.max_loras}, spec.rate)


def _workloads(bench: Bench, args: argparse.Namespace) -> dict[str, Any]:
    """The workload over every seed: requests in all, the rest the median trace's figures."""
    traces = [trace_summary(part.trace) for part in bench.parts]
    capacity = bench.capacity
    return {
        "requests": sum(t["requests"] for t in traces),
        "duration_s": median([t["duration_s"] for t in traces]),
        "adapters": median_low([t["adapters"] for t in traces]),
        "tenants": median_low([t["tenants"] for t in traces]),
        "mean_max_new_tokens": median([t["mean_max_new_tokens"] for t in traces]),
        "scenario": None if args.trace else args.scenario,
        "seeds": [part.seed for part in bench.parts if part.seed is not None] or None,
        "rate": None if args.trace else bench.rate,
        "load": args.load if capacity is not None else None,
        "capacity": None if capacity is None else asdict(capacity),
    }


def _progress(started: float, what: str) -> None:
    print(f"[{monotonic() - started:6.1f} s] {what}", file=sys.stderr, flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    from lora_guard.bench.arguments import add_arguments

    parser = argparse.ArgumentParser(prog="lora-guard bench", description=__doc__)
    add_arguments(parser)
    argv = list(sys.argv[1:] if argv is None else argv)
    return run(parser.parse_args(argv), ["bench", *argv])


if __name__ == "__main__":
    sys.exit(main())
