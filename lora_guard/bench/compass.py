"""The compass: lora-guard's figures against their targets, each a ratio within one run (a seed's
trace replayed by every scheme, once per ``--turns``: to static, to its own hit bound, to a peer),
then the median over the runs."""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from lora_guard.bench.stats import median

SUBJECT = "lora-guard"


@dataclass(frozen=True)
class Target:
    name: str
    key: str  # the subject's figure
    reference: str | None  # scheme it is divided by; "bound" for its own hit bound; None: as is
    reference_key: str
    better: str  # ">=" or "<="
    goal: float


TARGETS = (
    Target("tail tok/s vs static", "tail_tokens_per_s", "static", "tail_tokens_per_s", ">=", 0.9),
    Target("TTFT p95 vs static", "ttft_p95_ms", "static", "ttft_p95_ms", "<=", 2.0),
    Target("peak memory vs static", "peak_memory_mib", "static", "peak_memory_mib", "<=", 1.05),
    Target("hit rate vs its bound", "hit_rate", "bound", "hit_rate_bound", ">=", 0.9),
    Target("tok/s vs peft", "tokens_per_s", "peft", "tokens_per_s", ">=", 3.0),
    Target("tok/s vs vllm", "tokens_per_s", "vllm", "tokens_per_s", ">=", 1.0),
    Target("kv conflicts", "kv_conflicts", None, "", "<=", 0),
    Target("oracle mismatches", "oracle_mismatches", None, "", "<=", 0),
)
_COMPARE = {">=": operator.ge, "<=": operator.le}


def compass(per_seed: Sequence[dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Each target the runs can tell: its value per seed, median, spread, and met or missed."""
    found = {}
    for target in TARGETS:
        values = [v for one in per_seed if (v := _value(target, one)) is not None]
        if not values:
            continue
        middle = median(values)
        found[target.name] = {
            "value": middle,
            "spread": [min(values), max(values)],
            "per_seed": values,
            "target": f"{target.better} {target.goal}",
            "met": _COMPARE[target.better](middle, target.goal),
        }
    return found


def _value(target: Target, schemes: dict[str, dict[str, Any]]) -> float | None:
    subject = schemes.get(SUBJECT)
    if subject is None or subject.get(target.key) is None:
        return None
    value = float(subject[target.key])
    if target.reference is None:
        return value
    reference = subject if target.reference == "bound" else schemes.get(target.reference)
    if reference is None or not reference.get(target.reference_key):
        return None
    return value / float(reference[target.reference_key])


def compass_lines(found: dict[str, dict[str, Any]], seeds: int, turns: int = 1) -> list[str]:
    """A line a target: ``lora-guard tail tok/s vs static: 0.49 (0.45-0.52, 3 seeds), target
    >= 0.9: missed`` (``3 seeds x 2 turns`` with ``--turns 2``)."""
    runs = f"{seeds} seed{'s' if seeds > 1 else ''}" + (f" x {turns} turns" if turns > 1 else "")
    lines = []
    for name, figure in found.items():
        low, high = figure["spread"]
        spread = f" ({low:.3g}-{high:.3g}, {runs})" if seeds * turns > 1 else ""
        verdict = "met" if figure["met"] else "missed"
        lines.append(f"{SUBJECT} {name}: {figure['value']:.3g}{spread}, target {figure['target']}: "
                     f"{verdict}")  # fmt: skip
    return lines
