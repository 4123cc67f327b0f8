"""PNG plots of a bench report (matplotlib, from the ``bench`` extra)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lora_guard.bench.replay import SchemeRun
from lora_guard.bench.report import request_tokens_per_s

_BARS = (
    ("peak_memory_ratio", "peak memory (x static)"),
    ("swap_ms_p95", "adapter swap p95 (ms)"),
    ("tail_tokens_per_s", "slow-tail tokens/s (p5)"),
    ("ttft_p95_ms", "TTFT p95 (ms)"),
    ("tokens_per_s", "aggregate tokens/s"),
    ("hit_rate", "device hit rate"),
)


def write_plots(
    schemes: dict[str, dict[str, Any]], runs: dict[str, SchemeRun], folder: Path
) -> list[Path]:
    """Write table.png (the table as bars), latency.png (CDFs) and hit_rate.png."""
    plt = pyplot()
    folder.mkdir(parents=True, exist_ok=True)
    names = list(schemes)
    written = []

    fig, axes = plt.subplots(2, 3, figsize=(14, 7))
    for ax, (key, title) in zip(axes.flat, _BARS, strict=True):
        values = [schemes[n][key] or 0.0 for n in names]
        ax.bar(names, values, color=[colour(n) for n in names])
        if key == "hit_rate":
            bound = [schemes[n]["hit_rate_bound"] or 0.0 for n in names]
            ax.scatter(
                names,
                bound,
                marker="_",
                s=400,
                color="black",
                label="bound: Belady on its own binds",
            )
            ax.legend(fontsize=8)
        ax.set_title(title)
        ax.tick_params(axis="x", labelrotation=35, labelsize=8)
    fig.tight_layout()
    written.append(save(fig, folder / "table.png"))

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, run in runs.items():
        done = [r for r in run.records if r.finish is not None and r.error is None]
        speeds = sorted(s for r in done if (s := request_tokens_per_s(r)) is not None)
        ttft = sorted((r.first_token - r.arrival) * 1000 for r in done if r.first_token is not None)
        _cdf(left, speeds, name)
        _cdf(right, ttft, name)
    left.set_xlabel("per-request tokens/s (arrival to last token)")
    right.set_xlabel("time to first token (ms)")
    right.set_xscale("log")
    for ax in (left, right):
        ax.set_ylabel("share of requests")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    written.append(save(fig, folder / "latency.png"))

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name, run in runs.items():
        if run.lookups and name != "peft":
            times, rates = _rolling_hit_rate(run.lookups, window=20)
            ax.plot(times, rates, label=name, color=colour(name))
    ax.set_xlabel("time (s)")
    ax.set_ylabel("device hit rate, last 20 lookups")
    ax.set_ylim(0, 1.05)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    written.append(save(fig, folder / "hit_rate.png"))
    return written


def pyplot() -> Any:
    """matplotlib's pyplot, drawing to files; a clear exit where the extra is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("--plots needs matplotlib: pip install 'lora-guard[bench]'") from None
    return plt


def _cdf(ax: Any, values: list[float], name: str) -> None:
    if values:
        shares = [(i + 1) / len(values) for i in range(len(values))]
        ax.step(values, shares, where="post", label=name, color=colour(name))


def _rolling_hit_rate(
    lookups: list[tuple[float, bool]], window: int
) -> tuple[list[float], list[float]]:
    times, rates = [], []
    for i in range(len(lookups)):
        recent = lookups[max(0, i + 1 - window) : i + 1]
        times.append(lookups[i][0])
        rates.append(sum(hit for _, hit in recent) / len(recent))
    return times, rates


def colour(name: str) -> str:
    return {
        "static": "#7f7f7f",
        "on-demand": "#d62728",
        "lru": "#ff7f0e",
        "lora-guard": "#2ca02c",
        "lora-guard-observe": "#9467bd",
        "peft": "#1f77b4",
        "vllm": "#8c564b",
        "vllm-reserved": "#bcbd22",
        "llama.cpp": "#e377c2",
    }.get(name, "#17becf")


def save(fig: Any, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
