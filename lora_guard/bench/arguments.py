"""The flags of ``lora-guard bench`` (the engine's are ``lora-guard serve``'s,
``lora_guard.config.add_engine_flags``), and what they name: the seeds, each seed's trace, the
model and adapters."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar

from lora_guard.workload.scenarios import scenario
from lora_guard.workload.trace import (
    SCENARIOS,
    TraceError,
    TraceRequest,
    WorkloadSpec,
    make_trace,
    read_trace,
    write_trace,
)

SCHEMES = ("static", "on-demand", "lru", "lora-guard", "lora-guard-observe", "peft")
FULL_REQUESTS = 200
FULL_SEEDS = (0, 1, 2)
DEFAULT_LOAD = 0.7
QUICK_SPEC = WorkloadSpec(
    adapters=8,
    tenants=2,
    requests=32,
    rate=6.0,
    burst_every_s=2.0,
    burst_len_s=0.5,
    system_prompt_words=24,
    user_words_mean=8,
    output_mean=12,
    output_min=4,
    output_max=32,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from lora_guard.config import add_engine_flags

    spec = WorkloadSpec()
    add = parser.add_argument
    # The engine's flags as `lora-guard serve` has them. Where serve picks by the machine (device,
    # dtype, a quarter of free memory), the bench pins the CPU, float32 and a 768MiB pool: figures
    # comparable from run to run and machine to machine, every scheme (PEFT's too) alike.
    add_engine_flags(
        parser,
        ["model", "max_loras", "max_lora_rank", "kv_cache_memory", "dtype", "lora_dtype", "device"],
        defaults={"kv_cache_memory": "768MiB", "dtype": "float32", "device": "cpu"},
    )
    add("--adapter-dir", type=Path, help="folder of adapters (default: the demo adapters)")
    add("--trace", type=Path, help="replay this JSONL trace instead of generating one")
    add("--write-trace", type=Path, metavar="FILE", help="save the trace replayed here")
    add("--schemes", default=",".join(SCHEMES), help="comma-separated, from: " + ", ".join(SCHEMES))
    _add_workload_flags(add, spec)
    _add_run_flags(add)
    _add_sweep_flags(add)
    add("--json", type=Path, metavar="FILE", help="write the report as JSON")
    add("--plots", type=Path, metavar="DIR", help="write PNG plots (needs matplotlib)")


def _add_workload_flags(add: Any, spec: WorkloadSpec) -> None:
    """The trace: generated (its scenario, sizes and seeds) or given."""
    add("--adapters", type=int, default=spec.adapters, help="adapters in the generated trace")
    add("--tenants", type=int, default=spec.tenants)
    add("--requests", type=int, default=FULL_REQUESTS, help="requests per trace (per seed)")
    add(
        "--load",
        type=float,
        default=DEFAULT_LOAD,
        help="mean arrival rate as a share of this machine's measured base-model capacity",
    )
    add(
        "--rate",
        type=float,
        help="mean arrivals per second outside bursts, instead of --load (default against "
        f"--target: {spec.rate})",
    )
    add("--zipf", type=float, default=spec.zipf, help="Zipf exponent of adapter popularity")
    add(
        "--scenario",
        choices=SCENARIOS,
        default=spec.scenario,
        help="; ".join(f"{s.name}: {s.about}" for s in SCENARIOS.values())
        + " (the bench takes the adapters and tenants its flags give: --adapters 200 --tenants 8 "
        "for pressure's, --adapters 229 --tenants 8 for public's; virtual time's --scenario seed "
        "prints the article's table)",
    )
    add(
        "--system-prompt-words",
        type=int,
        default=spec.system_prompt_words,
        help="length of each tenant's shared system prompt",
    )
    add(
        "--user-words",
        type=float,
        default=spec.user_words_mean,
        help="mean length of the user part of a prompt",
    )
    add("--output-mean", type=float, default=spec.output_mean, help="mean max_new_tokens")
    add(
        "--seeds",
        type=_seeds,
        help="comma-separated trace seeds; each seed is a trace every scheme replays, and the "
        f"report gives medians and spreads (default: {','.join(map(str, FULL_SEEDS))}; "
        "--quick and --target: 0)",
    )
    add("--seed", type=int, dest="seeds", action=_OneSeed, help="one seed: --seeds N")
    add(
        "--turns",
        type=_positive,
        default=1,
        help="replays of each seed's trace by every scheme, the order of the schemes rotated "
        "each time (2 with two schemes: A B, then B A); each turn is a run of the report's medians",
    )


def _add_run_flags(add: Any) -> None:
    """How the schemes run: the cold-load budget, --quick, a running --target, a --peer."""
    add(
        "--cold-loads-per-minute",
        type=int,
        default=None,
        help="lora-guard's cold-load budget (default: the number of adapters in the trace)",
    )
    add(
        "--quick",
        action="store_true",
        help="a tiny random model and a short trace (a smoke run, about a minute)",
    )
    add(
        "--target",
        metavar="URL",
        help="replay against this running server instead (its metrics give hit rate, swaps, "
        "cold loads and conflicts; --model adds the oracle check)",
    )
    add("--target-name", default="target", help="the scheme name of the --target run")
    add(
        "--api-key",
        default="",
        help="bearer key for --target (an admin key where it has a key file: /metrics needs one)",
    )
    add(
        "--peer",
        type=_peers,
        default=(),
        help="also replay the trace on vLLM's CPU build, in its own virtual environment (made "
        "on first use under $LORA_GUARD_HOME/peers): vllm, vllm-lora-guard (with lora-guard's "
        "scheduler and door, docs/vllm.md), vllm-all-resident (vLLM alone with a seat for every "
        "adapter: the bound for any policy inside vLLM), comma-separated",
    )
    add("--peer-python", type=Path, help="an interpreter that has vLLM, instead of that venv")
    add("--peer-port", type=int, default=8701, help="loopback port for the peer")


def _add_sweep_flags(add: Any) -> None:
    """The capacity sweep (--sweep) and its systems."""
    add(
        "--sweep",
        type=_clients,
        metavar="N,N,...",
        help="measure capacity instead of replaying: each of --systems behind its own HTTP "
        "server, a closed loop of N clients for each N, each point's prompts new to the server "
        "(and doubled N, up to twice the last, while its throughput still rises by over 5%%), "
        "then the trace at --matched-load of the smallest capacity (docs/benchmarks.md)",
    )
    add(
        "--systems",
        default="lora-guard,peft,vllm",
        help="the servers --sweep measures, from: lora-guard, peft, vllm (every core computes), "
        "vllm-reserved (vLLM's documented layout: a core kept for its serving process), "
        "llama.cpp",
    )
    add(
        "--matched-load",
        type=float,
        default=0.5,
        help="--sweep's open-loop run: arrivals at this share of the smallest saturated rate",
    )
    add(
        "--base-share",
        type=float,
        default=0.0,
        help="share of the trace's requests for the base model (1: no adapter at all; with "
        "--sweep, every system is then started without adapters, its no-LoRA control)",
    )


#: the flags that set the WorkloadSpec field of the same name
_SPEC_FLAGS = "adapters tenants requests zipf output_mean scenario system_prompt_words base_share"


def workload_spec(args: argparse.Namespace) -> WorkloadSpec:
    """The trace the flags ask for (its rate is set later: by --rate, or by --load)."""
    flags = {name: getattr(args, name) for name in _SPEC_FLAGS.split()}
    return WorkloadSpec(**flags, user_words_mean=args.user_words)


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number of at least 1, got {text!r}")
    return value


#: peers ``--peer`` replays: vLLM alone, vLLM with lora-guard's scheduler and door, and vLLM alone
#: with a seat for every adapter (the bound for any policy inside vLLM)
PEERS = ("vllm", "vllm-lora-guard", "vllm-all-resident")


def _peers(text: str) -> tuple[str, ...]:
    return tuple(_listed(text, str.strip, set(PEERS).issuperset, f"peers from {', '.join(PEERS)}"))


def _clients(text: str) -> list[int]:
    return _listed(text, int, lambda counts: min(counts) >= 1, "client counts such as 1,2,4,8")


def _seeds(text: str) -> list[int]:
    return _listed(
        text, int, lambda seeds: len(set(seeds)) == len(seeds), "distinct seeds such as 0,1,2"
    )


T = TypeVar("T")


def _listed(
    text: str, item: Callable[[str], T], fits: Callable[[list[T]], bool], wanted: str
) -> list[T]:
    """The comma-separated items of ``text``, or argparse's error: expected ``wanted``."""
    try:
        items = [item(part) for part in text.split(",") if part.strip()]
    except ValueError:
        items = []
    if not items or not fits(items):
        raise argparse.ArgumentTypeError(f"expected {wanted}, got {text!r}")
    return items


class _OneSeed(argparse.Action):
    def __call__(self, parser: Any, namespace: Any, value: Any, option: Any = None) -> None:
        setattr(namespace, self.dest, [value])


def seeds_of(args: argparse.Namespace) -> list[int | None]:
    """The seeds the run replays (None: the --trace file's one trace)."""
    if args.trace:
        return [None]
    if args.seeds:
        return list(args.seeds)
    return [0] if args.quick or args.target else list(FULL_SEEDS)


def trace_of(
    args: argparse.Namespace, spec: WorkloadSpec, ids: list[str], seed: int | None
) -> list[TraceRequest]:
    """The trace a seed replays: --trace's, or one drawn from ``spec``; every adapter it names
    served (``ids``); saved where --write-trace says."""
    trace = read_trace(args.trace) if args.trace else make_trace(spec, ids)
    describe = None if args.trace else scenario(spec.scenario).describe
    if describe is not None:
        print(f"{spec.scenario} workload: {describe(spec)}", file=sys.stderr, flush=True)
    missing = sorted({r.adapter_id for r in trace if r.adapter_id} - set(ids))
    if missing:
        raise TraceError(f"the trace names adapters that are not served: {', '.join(missing)}")
    if args.write_trace:
        path = args.write_trace
        if seed is not None and len(seeds_of(args)) > 1:
            path = path.with_name(f"{path.stem}-seed{seed}{path.suffix}")
        write_trace(trace, path)
    return trace


def model_and_spec(args: argparse.Namespace, scratch: Path) -> tuple[Path, Path, WorkloadSpec]:
    """The model, the adapters and the workload the flags name (--quick: a tiny model made in
    ``scratch``; no --model: the demo's)."""
    spec = workload_spec(args)
    if args.quick:
        from lora_guard.demo.adapters import make_adapters
        from lora_guard.demo.testing import make_tiny_llama

        model = make_tiny_llama(scratch / "model", hidden_size=128, intermediate_size=256)
        adapters = scratch / "adapters"
        make_adapters(
            model, adapters, n=QUICK_SPEC.adapters, ranks=(4, 8, 16), strength=0.5, prefix="quick"
        )
        return model, adapters, replace(QUICK_SPEC, scenario=args.scenario)
    if args.model is None:
        from lora_guard.demo.model import prepare_demo

        demo = prepare_demo(log=lambda msg: print(msg, file=sys.stderr))
        return demo.model_dir, args.adapter_dir or demo.adapter_dir, spec
    if args.adapter_dir is None:
        raise SystemExit("error: --adapter-dir is needed with --model")
    return Path(args.model), args.adapter_dir, spec
