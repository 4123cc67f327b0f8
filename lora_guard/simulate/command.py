"""The ``lora-guard simulate`` command: routers compared over replica counts, or the engine's
costs measured (``--calibrate``)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from lora_guard.cost_profiles import PROFILES, profile, profiles_help
from lora_guard.simulate.routers import ROUTERS
from lora_guard.simulate.run import make_sim_trace, replica_capacity, simulate
from lora_guard.simulate_costs import Costs, read_costs

if TYPE_CHECKING:
    pass


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lora-guard simulate",
        description="many replicas and many adapters, routers compared on one trace",
        epilog="--calibrate measures the engine's costs on this machine instead of simulating.",
    )
    parser.add_argument("--adapters", type=int, default=1000)
    parser.add_argument("--replicas", default="8,16,64", help="comma-separated replica counts")
    parser.add_argument("--slots", type=int, default=8, help="adapter seats per replica")
    parser.add_argument("--host-slots", type=int, default=32, help="adapters in host memory")
    parser.add_argument("--requests", type=int, default=20000)
    parser.add_argument("--load", type=float, default=0.7, help="share of the fleet's capacity")
    parser.add_argument("--zipf", type=float, default=1.0)
    parser.add_argument("--routers", default=",".join(ROUTERS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--profile",
        choices=PROFILES,
        default="cpu-demo",
        help=f"the costs of a model on a device (docs/simulate.md): {profiles_help()}",
    )
    parser.add_argument(
        "--costs", type=Path, help="costs JSON written by --calibrate, over the profile's"
    )
    parser.add_argument(
        "--step-log",
        type=Path,
        metavar="FILE",
        help="fit the step and write costs to a step log (lora-guard serve "
        "--step-log FILE), over --costs or the profile's",
    )
    parser.add_argument(
        "--calibrate",
        type=Path,
        metavar="OUT.json",
        help="measure the engine's costs and write them here",
    )
    parser.add_argument(
        "--adapter-dir", type=Path, help="--calibrate: adapters (default: 8 made for the run)"
    )
    # The engine --calibrate measures, with `lora-guard serve`'s flags (imported here, as they
    # import torch: this module does not). It pins the CPU and float32 where serve picks by the
    # machine: costs measured like the defaults (the demo model in float32 on a CPU,
    # docs/simulate.md), one calibration comparable with the next.
    from lora_guard.config import add_engine_flags

    calibrate = parser.add_argument_group("the engine --calibrate measures")
    add_engine_flags(
        calibrate, ["model", "device", "dtype"], defaults={"device": "cpu", "dtype": "float32"}
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.calibrate is not None:
        from lora_guard.config import engine_names
        from lora_guard.simulate_costs import calibrate_command

        device, dtype = engine_names(args.device, args.dtype)
        model = Path(args.model) if args.model is not None else None
        return calibrate_command(args.calibrate, model, args.adapter_dir, device, dtype)
    costs = read_costs(args.costs) if args.costs else profile(args.profile).costs
    if args.step_log is not None:
        costs = _fitted(costs, args.step_log)
    routers = [r.strip() for r in args.routers.split(",") if r.strip()]
    print(f"costs: {costs.source}")
    print(
        "| replicas | router | loads per 1000 requests | hit rate | TTFT p50 ms | TTFT p95 ms "
        "| busiest replica's share |"
    )
    print("|---:|---|---:|---:|---:|---:|---:|")
    for replicas in (int(n) for n in args.replicas.split(",")):
        rate = args.load * replicas * replica_capacity(costs, 100.0, 180.0)
        trace = make_sim_trace(args.adapters, args.requests, rate, args.seed, args.zipf)
        for name in routers:
            result = simulate(
                trace, name, replicas, args.slots, costs, seed=args.seed, host_slots=args.host_slots
            )
            print(
                f"| {replicas} | {name} | {1000 * result.loads / result.requests:.0f} | "
                f"{result.hit_rate:.2f} | {result.ttft_p50_ms:.0f} | {result.ttft_p95_ms:.0f} "
                f"| {result.busiest_share:.2f} |",
                flush=True,
            )
    return 0


def _fitted(costs: Costs, step_log: Path) -> Costs:
    """``costs`` with the step and write costs fitted to the steps of ``step_log``."""
    from lora_guard.simulate_costs import fit_steps, read_step_log, with_step_fit

    try:
        steps = read_step_log(step_log)
        fit = fit_steps(steps, loads=True)
    except (OSError, ValueError, TypeError) as exc:
        raise SystemExit(f"lora-guard simulate: --step-log {step_log}: {exc}") from None
    fitted = with_step_fit(costs, fit, f"{costs.source}, the step fitted to {step_log.name}")
    print(
        f"step ms = {fitted.step_ms:.3f} + {fitted.step_per_seq_ms:.4f} x sequences + "
        f"{fitted.step_per_adapter_mib_ms:.4f} x adapter MiB + "
        f"{fitted.prefill_per_token_ms:.4f} x prefill tokens + {fitted.write_ms:.3f} x loads "
        f"(over {fit.samples} steps of {step_log.name}: {100 * fit.rms_relative:.0f}% RMS "
        f"relative)"
    )
    return fitted


if __name__ == "__main__":
    sys.exit(main())
