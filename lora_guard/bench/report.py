"""From scheme runs to the report: one summary per scheme, a Markdown table, JSON."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lora_guard.bench.load import RequestRecord
from lora_guard.bench.replay import SchemeRun
from lora_guard.workload.bounds import belady_hit_rate, compulsory_hit_bound
from lora_guard.workload.stats import median, percentile

MIB = 2**20


def request_tokens_per_s(record: RequestRecord) -> float | None:
    """Generated tokens over the time from arrival (trace time) to the last token."""
    if record.finish is None or record.error is not None or not record.tokens:
        return None
    return len(record.tokens) / max(record.finish - record.arrival, 1e-9)


def decode_tokens_per_s(record: RequestRecord) -> float | None:
    """Tokens after the first over the time from the first token to the last: the decode speed
    alone, without the wait for a place and the prefill."""
    if record.finish is None or record.error is not None or record.first_token is None:
        return None
    if len(record.tokens) < 2 or record.finish <= record.first_token:
        return None
    return (len(record.tokens) - 1) / (record.finish - record.first_token)


def tail_ttft_shares(records: Sequence[RequestRecord]) -> dict[str, float | None]:
    """What the 5% slowest first tokens spent their wait on: the share of their TTFT spent
    waiting for the adapter (its read, and room in the pool for it), and the share held back by
    a policy (the two overlap where a policy holds back a request whose adapter is out); the
    rest is queueing for a batch place and the prompt's prefill. None without such requests (or
    where the engine does not say: a peer's server)."""
    waits = sorted(
        (
            (r.first_token - r.arrival, r)
            for r in records
            if r.error is None and r.first_token is not None
        ),
        key=lambda pair: pair[0],
        reverse=True,
    )
    tail = waits[: max(1, len(waits) // 20)]
    total = sum(ttft for ttft, _ in tail)
    if total <= 0:
        return {"tail_adapter_wait_share": None, "tail_held_share": None}
    return {
        "tail_adapter_wait_share": sum(r.adapter_wait_s for _, r in tail) / total,
        "tail_held_share": sum(r.held_s for _, r in tail) / total,
    }


def hit_rates(run: SchemeRun) -> dict[str, float | None]:
    """The scheme's hit rate over its own binds, the bound no policy can pass on that sequence
    (every bind but each non-resident adapter's first: deferring and bypassing included), and
    Belady's optimum on the same sequence in its order (a reference: a policy that defers a
    miss can pass it)."""
    if not run.binds:
        hits = sum(hit for _, hit in run.lookups)
        return {
            "hit_rate": hits / len(run.lookups) if run.lookups else None,
            "hit_rate_bound": None,
            "hit_rate_belady": None,
        }
    needs = [b.adapter_id for b in run.binds]
    return {
        "hit_rate": sum(b.hit for b in run.binds) / len(needs),
        "hit_rate_bound": compulsory_hit_bound(needs, run.start_resident),
        "hit_rate_belady": belady_hit_rate(needs, run.slots, run.start_resident),
    }


def summarize(
    run: SchemeRun,
    mismatches: int | None,
    static: SchemeRun | None = None,
    seeds: list[int] | None = None,
    trace_adapters: int | None = None,
) -> dict[str, Any]:
    """The report's figures for one scheme (keys are the stable JSON names); None where the run
    cannot tell (no swaps, no memory accounting against a remote server, no oracle). ``seeds``
    are the trace's seeds (None for a trace read from a file); ``trace_adapters`` the distinct
    adapters it asks for (static's fleet has one instance each)."""
    done = [r for r in run.records if r.finish is not None and r.error is None]
    speeds = [s for r in done if (s := request_tokens_per_s(r)) is not None]
    decode = [s for r in done if (s := decode_tokens_per_s(r)) is not None]
    waits = [b.wait_ms for b in run.binds if b.wait_ms is not None]
    ttft = [(r.first_token - r.arrival) * 1000 for r in done if r.first_token is not None]
    tokens = sum(len(r.tokens) for r in done)
    span = max((r.finish for r in done if r.finish is not None), default=0.0) - min(
        (r.arrival for r in run.records), default=0.0
    )
    cold = run.cold_loads
    attempts = cold["loaded"] + cold["rejected"] + cold["failed"]
    served = [a for a in run.served if a is not None]
    fleet = None
    if run.scheme == "static" and run.memory and trace_adapters:
        fleet = run.memory["total"] * trace_adapters / MIB
    return {
        "requests": len(run.records),
        "completed": len(done),
        "failed": sum(r.error is not None for r in run.records),
        "retries": sum(r.retries for r in run.records),
        "peak_memory_mib": run.memory["total"] / MIB if run.memory else None,
        "peak_memory_ratio": _ratio(
            run.memory.get("total", 0), static.memory.get("total", 0) if static else 0
        ),
        "peak_rss_mib": run.peak_rss / MIB if run.peak_rss else None,
        "peak_rss_ratio": _ratio(run.peak_rss or 0, static.peak_rss or 0 if static else 0),
        "memory_mib": {k: v / MIB for k, v in run.memory.items()},
        "swaps": len(run.swap_ms),
        "evictions": run.evictions,
        "swap_ms_p50": percentile(run.swap_ms, 50),
        "swap_ms_p95": percentile(run.swap_ms, 95),
        "adapter_wait_ms_p50": percentile(waits, 50),
        "adapter_wait_ms_p95": percentile(waits, 95),
        "tail_tokens_per_s": percentile(speeds, 5),
        "decode_tail_tokens_per_s": percentile(decode, 5),
        "median_tokens_per_s": percentile(speeds, 50),
        "ttft_p50_ms": percentile(ttft, 50),
        "ttft_p95_ms": percentile(ttft, 95),
        "ttft_max_ms": max(ttft) if ttft else None,  # the longest any request waited
        # left out of the batch by a policy (hot-set's hold-backs), apart from the adapter wait;
        # None where no engine step was recorded here (a peer, a remote target)
        "held_ms_p95": percentile([r.held_s * 1000 for r in done], 95) if run.steps else None,
        **tail_ttft_shares(run.records if run.steps else []),
        "tokens_per_s": tokens / span if span > 0 else None,
        "generated_tokens": tokens,
        **hit_rates(run),
        # Arrival order from an empty pool: a figure of the trace, not a bound on a warm scheme.
        "belady_hit_rate": belady_hit_rate(served, run.slots) if served else None,
        "slots": run.slots,
        "cold_load_fail_ratio": (cold["rejected"] + cold["failed"]) / attempts if attempts else 0.0,
        "cold_loads": dict(cold),
        "kv_conflicts": run.kv_conflicts,
        "oracle_mismatches": mismatches,
        "fleet_memory_mib": fleet,
        "seeds": seeds,
        "duration_s": run.duration_s,
        "steps": step_summary(run),
    }


def step_summary(run: SchemeRun) -> dict[str, Any] | None:
    """Where the engine's steps went: their count, the prompt tokens they computed, and the step
    time fitted to ``fixed + per request + per MiB of adapter weights read + per prefill token``
    (None without step records, or too few to fit)."""
    from lora_guard.simulate_costs import fit_steps

    if not run.steps:
        return None
    summary: dict[str, Any] = {
        "steps": len(run.steps),
        "mean_step_ms": 1000 * sum(s.seconds for s in run.steps) / len(run.steps),
        "prefill_tokens": sum(s.prefill_tokens for s in run.steps),
        "mean_requests": sum(s.seqs for s in run.steps) / len(run.steps),
        "mean_adapters": sum(s.adapters for s in run.steps) / len(run.steps),
    }
    names = (
        "fit_fixed_ms",
        "fit_per_request_ms",
        "fit_per_adapter_mib_ms",
        "fit_per_prefill_token_ms",
    )
    try:
        coefficients: tuple[float | None, ...] = fit_steps(run.steps).coefficients
    except ValueError:
        coefficients = (None,) * len(names)
    return summary | dict(zip(names, coefficients, strict=True))


# Counts add up over seeds; every other figure is the median of the seeds' figures.
_SUMMED = frozenset(
    {
        "requests",
        "completed",
        "failed",
        "retries",
        "swaps",
        "evictions",
        "generated_tokens",
        "kv_conflicts",
        "oracle_mismatches",
    }
)


def aggregate(per_seed: Sequence[dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """One summary per scheme over the seeds' summaries: counts summed, figures as medians,
    ``spread`` the (min, max) of each figure, ``seeds`` every seed."""
    names = list(dict.fromkeys(name for one in per_seed for name in one))
    merged = {}
    for name in names:
        runs = [one[name] for one in per_seed if name in one]
        summary: dict[str, Any] = {}
        spread: dict[str, list[float]] = {}
        for key, first in runs[0].items():
            values = [run[key] for run in runs]
            if key == "seeds":
                seeds = [seed for value in values for seed in value or ()]
                summary[key] = seeds or None
            elif isinstance(first, dict):
                summary[key] = {
                    k: _combine(k in _SUMMED, [(v or {}).get(k) for v in values]) for k in first
                }
            else:
                summary[key] = _combine(key in _SUMMED, values)
                numbers = [v for v in values if isinstance(v, int | float)]
                if numbers and key not in _SUMMED:
                    spread[key] = [min(numbers), max(numbers)]
        summary["spread"] = spread
        merged[name] = summary
    return merged


def _combine(summed: bool, values: Sequence[Any]) -> Any:
    numbers = [v for v in values if isinstance(v, int | float) and not isinstance(v, bool)]
    if not numbers:
        return values[0] if len(values) == 1 else None
    if summed:
        return sum(numbers)
    return numbers[0] if len(numbers) == 1 else median(numbers)


def _ratio(value: float, reference: float) -> float | None:
    return value / reference if value and reference else None


_COLUMNS = (
    ("scheme", None),
    ("peak mem x static", "peak_memory_ratio"),
    ("peak RSS x static", "peak_rss_ratio"),
    ("swap ms p50", "swap_ms_p50"),
    ("swap ms p95", "swap_ms_p95"),
    ("adapter wait ms p50", "adapter_wait_ms_p50"),
    ("adapter wait ms p95", "adapter_wait_ms_p95"),
    ("held ms p95", "held_ms_p95"),
    ("tail tok/s", "tail_tokens_per_s"),
    ("decode tail tok/s", "decode_tail_tokens_per_s"),
    ("median tok/s", "median_tokens_per_s"),
    ("TTFT p50 ms", "ttft_p50_ms"),
    ("TTFT p95 ms", "ttft_p95_ms"),
    ("tok/s", "tokens_per_s"),
    ("hit rate", "hit_rate"),
    ("hit bound", "hit_rate_bound"),
    ("Belady, arrival order, cold", "belady_hit_rate"),
    ("cold fail", "cold_load_fail_ratio"),
    ("retries", "retries"),
    ("kv conflicts", "kv_conflicts"),
    ("oracle mismatches", "oracle_mismatches"),
    ("completed", "completed"),
)


def markdown_table(schemes: dict[str, dict[str, Any]]) -> str:
    lines = [
        "| " + " | ".join(title for title, _ in _COLUMNS) + " |",
        "|---|" + "---:|" * (len(_COLUMNS) - 1),
    ]
    for name, summary in schemes.items():
        cells = ["static (one-instance ceiling)" if name == "static" else name]
        for _, key in _COLUMNS[1:]:
            value = summary[key]
            if key == "completed":
                value = f"{value}/{summary['requests']}"
            cells.append(_cell(value))
        lines.append("| " + " | ".join(cells) + " |")
    static = schemes.get("static")
    if static and static.get("fleet_memory_mib"):
        lines.append(
            f"\nstatic serves every request with one adapter; a fleet of static instances, one "
            f"per adapter of the trace, would take {static['fleet_memory_mib']:.0f} MiB."
        )
    return "\n".join(lines)


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, int | str):
        return str(value)
    if abs(value) >= 100:
        return f"{value:.0f}"
    if abs(value) >= 10:
        return f"{value:.1f}"
    return f"{value:.2f}"
