"""The compass: lora-guard's figures against their targets, each a ratio within one run (a seed's
trace replayed by every scheme, once per ``--turns``: to static, to its own hit bound, to a peer),
then the median over the runs; counts no run may break are summed instead. A target a run set
cannot tell is printed with the reason, never as met: the hit rate where nothing was evicted,
speeds from a replay's makespan."""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from lora_guard.workload.stats import median

SUBJECT = "lora-guard"


@dataclass(frozen=True)
class Target:
    name: str
    key: str  # the subject's figure
    reference: str | None  # scheme it is divided by; "bound" for its own hit bound; None: as is
    reference_key: str
    better: str  # ">=" or "<="
    goal: float | None  # None: reported beside the others, never judged
    summed: bool = False  # a count no run may break: summed over the runs, not a median
    needs: str | None = None  # the subject's count that must be positive for a run to tell
    from_capacity: bool = False  # a speed: judged from capacity runs only, never a makespan


# one row a line, as a table reads (fmt: skip)
TARGETS = (
    Target("tail tok/s vs static", "tail_tokens_per_s", "static", "tail_tokens_per_s", ">=", 0.9),
    Target("TTFT p95 vs static", "ttft_p95_ms", "static", "ttft_p95_ms", "<=", 2.0),
    Target("peak RSS vs static", "peak_rss_mib", "static", "peak_rss_mib", "<=", 1.10),
    # the pool's own accounting: every scheme is given the same pool, so it cannot tell much
    Target("pool memory vs static", "peak_memory_mib", "static", "peak_memory_mib", "<=", None),
    Target("hit rate vs its bound", "hit_rate", "bound", "hit_rate_bound", ">=", 0.9,
           needs="evictions"),
    Target("tok/s vs peft", "tokens_per_s", "peft", "tokens_per_s", ">=", 3.0,
           from_capacity=True),
    Target("tok/s vs vllm", "tokens_per_s", "vllm", "tokens_per_s", ">=", 3.0,
           from_capacity=True),
    Target("kv conflicts", "kv_conflicts", None, "", "<=", 0, summed=True),
    Target("oracle mismatches", "oracle_mismatches", None, "", "<=", 0, summed=True),
)  # fmt: skip
_COMPARE = {">=": operator.ge, "<=": operator.le}
NOT_EXERCISED = "not exercised: lora-guard evicted no adapter in any run"
MAKESPAN = "not judged: a replay's tok/s is its makespan; speeds are judged from capacity runs"


def compass(per_seed: Sequence[dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Each target the runs can tell: its value per run, median (or sum), spread, and ``met``:
    True, False, or None with a ``note`` saying why it is not judged."""
    found = {}
    for target in TARGETS:
        runs = [one for one in per_seed if _value(target, one) is not None]
        if not runs:
            continue
        values = [v for one in runs if (v := _value(target, one)) is not None]
        figure: dict[str, Any] = {
            "value": sum(values) if target.summed else median(values),
            "spread": [min(values), max(values)],
            "per_seed": values,
            "target": "reported" if target.goal is None else f"{target.better} {target.goal}",
            "met": None,
        }
        if target.needs is not None:
            telling = [
                v
                for one, v in zip(runs, values, strict=True)
                if (one[SUBJECT].get(target.needs) or 0) > 0
            ]
            if not telling:
                figure["note"] = NOT_EXERCISED
            else:
                figure["value"] = median(telling)
        if target.from_capacity:
            figure["note"] = MAKESPAN
        if target.goal is not None and "note" not in figure:
            figure["met"] = _COMPARE[target.better](figure["value"], target.goal)
        found[target.name] = figure
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
        verdict = {True: "met", False: "missed", None: figure.get("note", "reported")}
        lines.append(
            f"{SUBJECT} {name}: {figure['value']:.3g}{spread}, target {figure['target']}: "
            f"{verdict[figure['met']]}"
        )
    return lines
