"""A virtual-time study: every scheme on each seed's trace in a pool sized for it
(``study``), and the report: medians over the seeds, lora-guard's ratios per seed, the
storm's isolation, the article's table."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from lora_guard.bench.capacity import arrival_rate
from lora_guard.bench.virtual.replay import Result
from lora_guard.bench.virtual.schemes import (
    ALL_RESIDENT,
    CLAIRVOYANT,
    SEATED,
    Bench,
    capacity,
    run_scheme,
    run_seated,
)
from lora_guard.cost_profiles import Profile
from lora_guard.simulate_costs import MIB
from lora_guard.workload.scenarios import scenario
from lora_guard.workload.stats import percentile
from lora_guard.workload.trace import (
    TraceRequest,
    WorkloadSpec,
    make_trace,
)

PRESSURE_FACTOR = 3.0  # adapters in use over a minute / the room beside the KV the load needs

WINDOW_S = 60.0


def window_bytes(trace: Sequence[TraceRequest], sizes: dict[str, int]) -> list[int]:
    """Bytes of the distinct adapters each full ``WINDOW_S`` window of ``trace`` asks for (one
    window starting at each request); a trace shorter than a window is one window."""
    asked = [(r.time, r.adapter_id) for r in trace if r.adapter_id is not None]
    end = asked[-1][0] if asked else 0.0
    out = []
    for i, (start, _) in enumerate(asked):
        if start + WINDOW_S > end:
            break
        names = {a for t, a in asked[i:] if t < start + WINDOW_S}
        out.append(sum(sizes[a] for a in names))
    return out or [sum(sizes[a] for a in {a for _, a in asked})]


@dataclass
class Pressure:
    """How the pool of a ``pressure`` study is sized: the KV the load needs, and room for a
    third of the adapters in use over a minute. The KV is the most an LRU replay of the same
    trace held with every adapter fitting: with adapter-scoped keys each adapter's requests
    cache their prompts apart, so the adapters' load holds more KV than the base model's."""

    kv_bytes: int
    window_bytes_p10: int
    window_bytes_p50: int
    scale: float = 1.0  # bytes on the profile's model per byte here, for the summary

    @property
    def cache_memory(self) -> int:
        return self.kv_bytes + int(self.window_bytes_p10 / PRESSURE_FACTOR)

    def summary(self) -> dict[str, Any]:
        room = max(self.cache_memory - self.kv_bytes, 1)
        return {
            "kv_mib": self.kv_bytes * self.scale / MIB,
            "adapter_room_mib": room * self.scale / MIB,
            "cache_memory_mib": self.cache_memory * self.scale / MIB,
            "in_use_per_minute_over_room_p10": self.window_bytes_p10 / room,
            "in_use_per_minute_over_room_p50": self.window_bytes_p50 / room,
        }


@dataclass
class SeedRun:
    seed: int | None
    rate: float | None
    results: list[Result]
    pressure: Pressure | None = None
    calm: list[Result] = field(default_factory=list)  # tenant-storm: the trace without the storm
    bound: dict[str, Any] | None = None  # the TTFT p95 no schedule gets under (virtual/bound.py)


def study(
    bench: Bench,
    spec: WorkloadSpec,
    schemes: Sequence[str],
    load: float,
    trace: list[TraceRequest] | None = None,
    cache_memory: int | None = None,
    bound: bool = False,
) -> SeedRun:
    """Every scheme on one trace (``trace``, or one drawn from ``spec`` at ``load`` of the
    capacity). The pool is ``cache_memory`` (bytes of the profile's model), or for ``pressure``
    and ``public`` sized by :class:`Pressure`, else the profile's memory for KV and adapters.
    ``bound``: with the TTFT p95 no schedule of the trace on that pool gets under."""
    rate = None
    if trace is None:
        rate = arrival_rate(spec, load, capacity(bench, spec))
        trace = make_trace(replace(spec, rate=rate), bench.adapter_ids)
    results: dict[str, Result] = {}
    pressure = None
    chosen = scenario(spec.scenario)
    if cache_memory is None and chosen.sized_pool:
        _, kv_bytes = run_scheme(bench, "lru", trace, 64 * MIB)
        windows = window_bytes(trace, bench.adapter_bytes)
        pressure = Pressure(
            kv_bytes,
            int(percentile(windows, 10) or 0),
            int(percentile(windows, 50) or 0),
            bench.scale,
        )
        pool = pressure.cache_memory
    else:
        pool = int((cache_memory or bench.profile.memory_bytes) / bench.scale)
    for scheme in schemes:
        if scheme not in results:
            results[scheme] = _run(bench, scheme, trace, pool)
    calm = []
    if chosen.calm is not None and rate is not None:
        quiet = make_trace(replace(spec, rate=rate, scenario=chosen.calm), bench.adapter_ids)
        calm = [_run(bench, s, quiet, pool) for s in schemes]
    run = SeedRun(spec.seed, rate, [results[s] for s in schemes], pressure, calm)
    if bound:
        from lora_guard.bench.virtual.bound import trace_bound

        run.bound = trace_bound(bench, trace, pool)
    return run


def _run(bench: Bench, scheme: str, trace: Sequence[TraceRequest], pool: int) -> Result:
    if scheme in SEATED:
        return run_seated(bench, scheme, trace, pool)
    return run_scheme(bench, scheme, trace, pool)[0]


def report(runs: Sequence[SeedRun], schemes: Sequence[str]) -> dict[str, Any]:
    """Medians over the seeds of each scheme's figures (``completed`` and ``requests`` summed),
    each seed's figures under ``runs``, and each tenant's TTFT p95."""
    per_scheme: dict[str, list[dict[str, Any]]] = {s: [] for s in schemes}
    tenants: dict[str, dict[str, list[float]]] = {}
    for run in runs:
        for result in run.results:
            per_scheme[result.scheme].append(result.figures())
            for tenant, p95 in result.tenant_ttft_p95().items():
                if p95 is not None:
                    tenants.setdefault(tenant, {}).setdefault(result.scheme, []).append(p95)
    out: dict[str, Any] = {"schemes": {}, "tenants": {}, "runs": []}
    for scheme, rows in per_scheme.items():
        merged: dict[str, Any] = {}
        for key in rows[0]:
            values = [row[key] for row in rows]
            if key in ("completed", "requests", "retries"):
                merged[key] = sum(values)
            elif all(isinstance(v, int | float) for v in values):
                merged[key] = statistics.median(values)
            elif key != "scheme":
                merged[key] = None
        out["schemes"][scheme] = merged
    for tenant, by_scheme in sorted(tenants.items()):
        out["tenants"][tenant] = {
            s: {"ttft_p95_ms": statistics.median(v)} for s, v in by_scheme.items()
        }
    storm = [run for run in runs if run.calm]
    if storm:
        per_seed = {s: [_storm_ratio(run, s) for run in storm] for s in schemes}
        out["storm"] = {s: statistics.median(v) for s, v in per_seed.items()}
        out["storm_per_seed"] = per_seed
    for run in runs:
        out["runs"].append(
            {
                "seed": run.seed,
                "rate": run.rate,
                "pool": run.pressure.summary() if run.pressure else None,
                "schemes": {r.scheme: r.figures() for r in run.results},
                "seat_sweeps": {r.scheme: r.seats for r in run.results if r.seats},
                "bound": run.bound,
            }
        )
    versus = lora_guard_ratios(out["runs"])
    if versus:
        out["lora_guard_over"] = versus
    over_bound = bound_ratios(out["runs"])
    if over_bound:
        out["over_bound"] = over_bound
    return out


def bound_ratios(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Each scheme's TTFT p95 over the seed's bound (``virtual/bound.py``), and the best
    rival's, per seed, then their median and range; none where a seed has no bound."""
    per_seed: dict[str, list[float]] = {}
    for run in runs:
        if not run.get("bound"):
            return {}
        floor = run["bound"]["ttft_p95_ms"]
        rows = run["schemes"]
        rivals = rival_rows(rows)
        figures = {s: r["ttft_p95_ms"] for s, r in rows.items()}
        if rivals:
            figures["best rival"] = min(r["ttft_p95_ms"] for r in rivals.values())
        for name, p95 in figures.items():
            if p95:
                per_seed.setdefault(name, []).append(p95 / floor)
    return {
        name: {"per_seed": v, "median": statistics.median(v), "range": [min(v), max(v)]}
        for name, v in per_seed.items()
        if len(v) == len(runs)
    }


#: not rivals: the base model (no adapters), the reference that adds memory, one adapter merged
#: for good (it serves one adapter's load, not the trace), lora-guard itself
NOT_RIVALS = ("base", ALL_RESIDENT, CLAIRVOYANT, "static", "lora-guard")


def rival_rows(rows: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The rivals' figures among a seed's ``rows``: every scheme not in ``NOT_RIVALS`` with a
    TTFT p95."""
    return {s: r for s, r in rows.items() if s not in NOT_RIVALS and r["ttft_p95_ms"]}


def lora_guard_ratios(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """lora-guard's TTFT p95 over the best rival's and each scheme's, and its tail tokens/s over
    the best rival's, per seed first, then their median and range (the same way for every
    figure)."""
    per_seed: dict[str, list[float]] = {}
    best_names = []
    for run in runs:
        rows = run["schemes"]
        ours = rows.get("lora-guard")
        rivals = rival_rows(rows)
        if ours is None or not ours["ttft_p95_ms"] or not rivals:
            return {}
        best = min(rivals, key=lambda s: rivals[s]["ttft_p95_ms"])
        best_names.append(best)
        ratios = {"best rival ttft_p95": ours["ttft_p95_ms"] / rivals[best]["ttft_p95_ms"]}
        tails = [r["tail_tokens_per_s"] for r in rivals.values() if r["tail_tokens_per_s"]]
        if tails and ours["tail_tokens_per_s"]:
            ratios["best rival tail_tokens_per_s"] = ours["tail_tokens_per_s"] / max(tails)
        for scheme, row in rows.items():
            if scheme != "lora-guard" and row["ttft_p95_ms"]:
                ratios[f"{scheme} ttft_p95"] = ours["ttft_p95_ms"] / row["ttft_p95_ms"]
        for name, value in ratios.items():
            per_seed.setdefault(name, []).append(value)
    return {
        "best_rival_by_seed": best_names,
        **{
            name: {
                "per_seed": values,
                "median": statistics.median(values),
                "range": [min(values), max(values)],
            }
            for name, values in per_seed.items()
        },
    }


def _storm_ratio(run: SeedRun, scheme: str) -> float:
    """The other tenants' TTFT p95 with tenant t0's storm over the same without it."""

    def others_p95(results: list[Result]) -> float:
        result = next(r for r in results if r.scheme == scheme)
        ttft = [
            (r.first_token - r.arrival) * 1000
            for r in result.records
            if r.first_token is not None and result.tenants[r.id] != "t0"
        ]
        return percentile(ttft, 95) or 0.0

    calm = others_p95(run.calm)
    return others_p95(run.results) / calm if calm else float("inf")


#: the seed's table (2 A10s, 24 adapters, 180 output tokens on average): peak memory over the
#: device's, adapter_swap_ms, P95 tokens/s, and the typical problem it names
SEED_SCHEMES = ("static", "on-demand", "lru", "lora-guard")

SEED_FIGURES: dict[str, dict[str, Any]] = {
    scheme: {"peak_memory": peak, "switch_ms": ms, "p95_tokens_per_s": speed, "problem": problem}
    for scheme, peak, ms, speed, problem in (
        ("static", 0.78, 8, 44, "inflexible, many instances"),
        ("on-demand", 0.92, 180, 31, "jitter, cold requests queue"),
        ("lru", 0.84, 46, 40, "cost and stability balanced"),
    )
}


def seed_table(rows: dict[str, dict[str, Any]], chosen: Profile) -> dict[str, dict[str, Any]]:
    """The article's four columns for each scheme (medians over the seeds), the article's own
    figures beside: peak memory over the device's, adapter switch ms, P95 tokens/s (the decode
    speed 95% of requests beat), the cold failure ratio."""
    table = {}
    for scheme, row in rows.items():
        peak = chosen.weights_bytes + row["peak_pool_mib"] * MIB
        table[scheme] = {
            "peak_memory": peak / chosen.device_bytes,
            "switch_ms": row["switch_ms"],
            "p95_tokens_per_s": row["decode_tail_tokens_per_s"],
            "cold_fail_ratio": row["cold_fail_ratio"],
            "seed": SEED_FIGURES.get(scheme),
        }
    return table


def print_seed_table(table: dict[str, dict[str, Any]]) -> None:
    print(
        "| scheme | peak memory / device | adapter switch ms | P95 tokens/s | cold failure ratio |"
    )
    print("|---|---:|---:|---:|---:|")
    for scheme, row in table.items():
        seed = row["seed"] or {}

        def cell(value: float | None, theirs: float | None, digits: str) -> str:
            ours = "-" if value is None else format(value, digits)
            return ours if theirs is None else f"{ours} (seed {format(theirs, digits)})"

        print(
            f"| {scheme} | {cell(row['peak_memory'], seed.get('peak_memory'), '.2f')} | "
            f"{cell(row['switch_ms'], seed.get('switch_ms'), '.0f')} | "
            f"{cell(row['p95_tokens_per_s'], seed.get('p95_tokens_per_s'), '.1f')} | "
            f"{cell(row['cold_fail_ratio'], None, '.3f')} |"
        )


def print_report(out: dict[str, Any], runs: Sequence[SeedRun]) -> None:
    """The study's figures as the command prints them: the setting, each seed's pool, the
    table of medians, the storm's isolation and lora-guard's ratios."""
    rates = ", ".join(f"{r.rate:.3f}/s" for r in runs if r.rate is not None)
    print(
        f"virtual time: {out['scenario']}, seeds {out['seeds']}, {out['requests']} requests a "
        f"seed, load {out['load']} (rate {rates or 'from the trace'} outside bursts), "
        f"max_loras {out['max_loras']}; profile {out['profile']} ({out['model']}, bytes "
        f"{out['bytes_scale']:g}x the tiny model's); costs: {out['costs']}"
    )
    for run in runs:
        if run.pressure:
            pool = run.pressure.summary()
            print(
                f"seed {run.seed}: pool {pool['cache_memory_mib']:.1f} MiB = KV "
                f"{pool['kv_mib']:.1f} + adapter room {pool['adapter_room_mib']:.1f}; adapters "
                f"in use over a minute {pool['in_use_per_minute_over_room_p50']:.1f}x the room "
                f"(median; 10th percentile {pool['in_use_per_minute_over_room_p10']:.1f}x)"
            )
    rows = list(out["schemes"].values())
    keys = ["scheme", *[k for k in rows[0] if k != "scheme"]] if rows else []
    print("| " + " | ".join(keys) + " |")
    print("|" + "---|" * len(keys))
    for scheme, row in out["schemes"].items():
        print("| " + " | ".join(_cell(scheme if k == "scheme" else row[k]) for k in keys) + " |")
    if "storm" in out:
        print(
            "other tenants' TTFT p95, storm / no storm: "
            + ", ".join(
                f"{s} {v:.2f}x (per seed "
                + ", ".join(f"{x:.2f}" for x in out["storm_per_seed"][s])
                + ")"
                for s, v in out["storm"].items()
            )
        )
    for run in runs:
        if run.bound:
            print(
                f"seed {run.seed}: no schedule of the trace on this pool that neither parks nor "
                f"preempts a running request has a TTFT p95 under "
                f"{run.bound['ttft_p95_ms']:.0f} ms (virtual/bound.py), and none at all under "
                f"its prefills alone, {run.bound['alone_prefill_p95_ms']:.0f} ms"
            )
    for name, ratio in out.get("over_bound", {}).items():
        print(
            f"{name} / the bound: median {ratio['median']:.2f} (range {ratio['range'][0]:.2f}-"
            f"{ratio['range'][1]:.2f})"
        )
    for name, ratio in out.get("lora_guard_over", {}).items():
        if name != "best_rival_by_seed":
            print(
                f"lora-guard / {name}: median {ratio['median']:.3f} (range "
                f"{ratio['range'][0]:.3f}-{ratio['range'][1]:.3f}; per seed "
                + ", ".join(f"{v:.3f}" for v in ratio["per_seed"])
                + ")"
            )


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value)
