"""The capacity sweep's report: lora-guard's targets over each peer, the table, the plot; and
the targets over several runs (``python -m lora_guard.bench.sweep_report RUN.json ...``): each
run's ratio, then their median with the range."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from lora_guard.bench.systems import SYSTEMS

MACHINE_SHARE_TARGET = 0.5  # lora-guard's saturated FLOPs a second, at least this of the machine's
LATENCY_TARGET = 0.5  # lora-guard's TTFT p95 at matched load, at most this share of each peer's
VLLM_LAYOUTS = ("vllm", "vllm-reserved")  # vLLM's two core layouts: its better one is headlined


def sweep_targets(systems: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """lora-guard's saturated throughput against the machine's matrix rate, and its saturated
    and one-client throughput and matched-load TTFT p95 against each peer's, by each peer's
    goals (``systems.SYSTEMS``)."""
    ours = systems.get("lora-guard")
    if ours is None:
        return []
    saturated = ours["saturated"]["tokens_per_s"]
    found = []
    share = ours["saturated"].get("machine_share")
    if share is not None:
        what = "saturated tok/s x FLOPs a token over the machine's matrix rate"
        found.append(_target(what, f">= {MACHINE_SHARE_TARGET:g}", share))
    for peer, entry in SYSTEMS.items():
        goal = entry.throughput_goal
        if goal is None or peer not in systems:
            continue
        theirs = systems[peer]
        ratio = _ratio(saturated, theirs["saturated"]["tokens_per_s"])
        found.append(_target(f"saturated tok/s vs {peer}", f">= {goal:g}x", ratio))
        one = entry.one_client_goal
        ratio = _ratio(_one_client(ours), _one_client(theirs))
        if one is not None and ratio is not None:
            found.append(_target(f"tok/s at one client vs {peer}", f">= {one:g}x", ratio))
        if "matched" in ours and "matched" in theirs:
            ratio = _ratio(ours["matched"]["ttft_p95_ms"], theirs["matched"]["ttft_p95_ms"])
            what = f"TTFT p95 at matched load vs {peer}"
            found.append(_target(what, f"<= {LATENCY_TARGET:g}x", ratio))
    vllm = [systems[n]["saturated"]["tokens_per_s"] for n in VLLM_LAYOUTS if n in systems]
    goal = SYSTEMS["vllm"].throughput_goal
    if len(vllm) > 1 and goal is not None:
        ratio = _ratio(saturated, max(vllm))
        found.append(_target("saturated tok/s vs vllm's better layout", f">= {goal:g}x", ratio))
    return found


def _target(what: str, goal: str, value: float | None) -> dict[str, Any]:
    return {
        "what": what,
        "goal": goal,
        "value": value,
        "met": value is not None and meets(goal, value),
    }


def runs_summary(reports: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each target of :func:`sweep_targets` over ``reports`` (sweep JSONs, one a run): its value
    in each run (None where the run lacks it), their median and range, and whether the median
    meets the goal."""
    by_what: dict[str, dict[str, Any]] = {}
    for i, report in enumerate(reports):
        for t in sweep_targets(report["systems"]):
            entry = by_what.setdefault(
                t["what"], {"what": t["what"], "goal": t["goal"], "runs": [None] * len(reports)}
            )
            entry["runs"][i] = t["value"]
    for entry in by_what.values():
        values = [v for v in entry["runs"] if v is not None]
        entry["median"] = statistics.median(values) if values else None
        entry["range"] = [min(values), max(values)] if values else None
        entry["met"] = entry["median"] is not None and meets(entry["goal"], entry["median"])
    return list(by_what.values())


def meets(goal: str, value: float) -> bool:
    """Whether ``value`` meets a target's goal as written (``">= 3x"``, ``"<= 0.5x"``)."""
    op, bound = goal.split()
    limit = float(bound.rstrip("x"))
    return value >= limit if op == ">=" else value <= limit


def summary_lines(summary: list[dict[str, Any]]) -> list[str]:
    lines = []
    for entry in summary:
        unit = "x" if entry["goal"].endswith("x") else ""

        def text(v: float | None, unit: str = unit) -> str:
            return "-" if v is None else f"{v:.3g}{unit}"

        runs = ", ".join(text(v) for v in entry["runs"])
        span = "" if entry["range"] is None else " ({}-{})".format(*map(text, entry["range"]))
        verdict = "met" if entry["met"] else "missed"
        lines.append(
            f"{entry['what']}: {runs}; median {text(entry['median'])}{span} "
            f"(target {entry['goal']}): {verdict}"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m lora_guard.bench.sweep_report",
        description="lora-guard's targets over several sweep runs (lora-guard bench --sweep "
        "--json): each run's value, then their median with the range",
    )
    parser.add_argument("runs", nargs="+", type=Path, help="a sweep's JSON, one a run")
    args = parser.parse_args(argv)
    try:
        reports = [json.loads(path.read_text()) for path in args.runs]
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not all(isinstance(r, dict) and "systems" in r for r in reports):
        print("error: not a sweep's JSON (no 'systems')", file=sys.stderr)
        return 2
    print(f"runs: {', '.join(str(p) for p in args.runs)}")
    print("\n".join(summary_lines(runs_summary(reports))))
    return 0


def _one_client(found: dict[str, Any]) -> float | None:
    return next((p["tokens_per_s"] for p in found.get("points", ()) if p["clients"] == 1), None)


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def target_lines(targets: list[dict[str, Any]]) -> list[str]:
    lines = []
    for t in targets:
        unit = "x" if t["goal"].endswith("x") else ""  # a ratio; a share has none
        value = "-" if t["value"] is None else f"{t['value']:.3g}{unit}"
        lines.append(
            f"{t['what']}: {value} (target {t['goal']}): {'met' if t['met'] else 'missed'}"
        )
    return lines


def sweep_table(systems: dict[str, dict[str, Any]]) -> str:
    rows = [
        "| system | clients | tok/s | TTFT p50 | TTFT p95 | e2e p95 | done | prefix cache hit "
        "| machine GFLOP/s | of the machine |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, found in systems.items():
        best = found["saturated"]["clients"]
        for p in [*found["points"], *([found["matched"]] if "matched" in found else [])]:
            clients = str(p["clients"]) if p["clients"] else "matched load"
            mark = " (saturated)" if p["clients"] == best else ""
            rows.append(
                f"| {name} | {clients}{mark} | {p['tokens_per_s']:.1f} | "
                f"{ms(p['ttft_p50_ms'])} | {ms(p['ttft_p95_ms'])} | "
                f"{ms(p['e2e_p95_ms'])} | {p['completed']}/{p['requests']} | "
                f"{share_text(p.get('prefix_cache_hit_rate'))} | "
                f"{gflops_text(p.get('machine_gflops'))} | "
                f"{share_text(p.get('machine_share'))} |"
            )
    return "\n".join(rows)


def write_sweep_plot(systems: dict[str, dict[str, Any]], folder: Path) -> list[Path]:
    """capacity.png: tok/s and TTFT p95 against the clients in the loop, a line per system."""
    from lora_guard.bench.plots import colour, pyplot, save

    plt = pyplot()
    folder.mkdir(parents=True, exist_ok=True)
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, found in systems.items():
        clients = [p["clients"] for p in found["points"]]
        for ax, key in ((left, "tokens_per_s"), (right, "ttft_p95_ms")):
            values = [p[key] for p in found["points"]]
            ax.plot(clients, values, marker="o", label=name, color=colour(name))
    left.set_ylabel("generated tokens/s (all clients busy)")
    right.set_ylabel("TTFT p95 (ms)")
    right.set_yscale("log")
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("clients in the closed loop")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    return [save(fig, folder / "capacity.png")]


def ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f} ms"


def share_text(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def gflops_text(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


if __name__ == "__main__":
    sys.exit(main())
