"""Percentiles and medians of the bench's figures (no torch: the simulator uses them too)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lora_guard.workload.trace import TraceRequest


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0-100), interpolated between ranks; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def median(values: Sequence[float]) -> float:
    """The median; 0.0 for no values."""
    middle = percentile(values, 50)
    return 0.0 if middle is None else middle


def describe_trace(trace: list[TraceRequest]) -> str:
    w = trace_summary(trace)
    return (
        f"trace: {w['requests']} requests over {w['duration_s']:.0f} s, {w['adapters']} adapters, "
        f"{w['tenants']} tenants, mean max_new_tokens {w['mean_max_new_tokens']:.0f}"
    )


def trace_summary(trace: list[TraceRequest]) -> dict[str, Any]:
    return {
        "requests": len(trace),
        "duration_s": trace[-1].time,
        "adapters": len({r.adapter_id for r in trace if r.adapter_id}),
        "tenants": len({r.tenant for r in trace}),
        "mean_max_new_tokens": _mean([r.max_new_tokens for r in trace]),
    }


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0
