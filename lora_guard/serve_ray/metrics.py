"""The fleet's ``/metrics``: the engine replicas' Prometheus samples, made into figures that stay
true for the fleet.

- Counters and histograms add up (lookups, swaps, cold loads, conflicts), as do TGI's request
  counts (gauges that only go up), so ``lora-guard bench --target`` reads a fleet as it reads
  one server.
- Ratios are computed again from the summed samples they come from: the hit rate from the
  lookups, the cold-load fail ratio from the cold loads, the KV and memory shares from the pool's
  bytes. A sum of ratios is no ratio (two replicas at 0.5 are not a fleet at 1.0). The fleet's
  hit rate and fail ratio are over the counters since each replica started: a fleet has no one
  sliding window (PromQL's ``rate`` over the summed counters gives one).
- Every other gauge (requests running and waiting, residency, the pool's bytes, vLLM's
  ``lora_requests_info``) is kept per replica with a ``replica`` label, to be aggregated in
  PromQL as the dashboard needs.

``_created`` timestamps are left out.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from prometheus_client.parser import text_string_to_metric_families

Labels = tuple[tuple[str, str], ...]
Samples = dict[tuple[str, Labels], float]  # (sample name, labels) -> value

SUMMED_GAUGES = frozenset({"tgi_request_count", "tgi_request_success", "tgi_request_failure"})


def _share(numerator: Callable[[Labels], bool], family: str) -> Callable[[Samples], float]:
    """The summed samples of ``family`` whose labels ``numerator`` takes, over all of them
    (0 when there are none, as each replica's gauge says: never NaN)."""

    def ratio(summed: Samples) -> float:
        rows = [(labels, v) for (name, labels), v in summed.items() if name == family]
        total = sum(v for _, v in rows)
        return sum(v for labels, v in rows if numerator(labels)) / total if total else 0.0

    return ratio


def _label_in(key: str, values: set[str]) -> Callable[[Labels], bool]:
    return lambda labels: dict(labels).get(key) in values


#: ratio gauge -> how the fleet's value comes from the summed samples
RATIOS: dict[str, Callable[[Samples], float]] = {
    "lora_guard_hot_adapter_hit_rate": _share(
        _label_in("result", {"hot"}), "lora_guard_adapter_lookups_total"
    ),
    "lora_guard_cold_load_fail_ratio": _share(
        _label_in("outcome", {"rejected", "failed"}), "lora_guard_cold_loads_total"
    ),
    "vllm:kv_cache_usage_perc": _share(_label_in("kind", {"kv"}), "lora_guard_cache_pool_bytes"),
    "lora_guard_memory_watermark": _share(
        _label_in("kind", {"kv", "adapter"}), "lora_guard_cache_pool_bytes"
    ),
}


def merge_metrics(texts: Mapping[str, str]) -> str:
    """One Prometheus text for the fleet from each replica's (``replica`` -> text)."""
    families: dict[str, tuple[str, str]] = {}  # name -> (type, help)
    summed: dict[str, Samples] = {}  # every family, summed over the replicas
    kept: dict[str, Samples] = {}  # every family per replica, with its label
    adds = set(SUMMED_GAUGES) | set(RATIOS)  # the families the fleet shows summed
    for replica, text in texts.items():
        for family in text_string_to_metric_families(text):
            families.setdefault(family.name, (family.type, family.documentation))
            if family.type in ("counter", "histogram", "summary"):
                adds.add(family.name)
            rows, own = summed.setdefault(family.name, {}), kept.setdefault(family.name, {})
            for sample in family.samples:
                if sample.name.endswith("_created"):
                    continue
                labels = tuple(sorted(sample.labels.items()))
                rows[sample.name, labels] = rows.get((sample.name, labels), 0.0) + sample.value
                own[sample.name, tuple(sorted((*labels, ("replica", replica))))] = sample.value
    every: Samples = {key: v for rows in summed.values() for key, v in rows.items()}
    for name, ratio in RATIOS.items():
        if name in summed:  # the replicas report it
            summed[name] = {(name, ()): ratio(every)}
    lines = []
    for name, (kind, doc) in families.items():
        rows = (summed if name in adds else kept)[name]
        if not rows:
            continue
        lines.append(f"# HELP {name} {_escape(doc, help_text=True)}")
        lines.append(f"# TYPE {name} {kind}")
        for (sample_name, labels), value in rows.items():
            rendered = ",".join(f'{k}="{_escape(v)}"' for k, v in labels)
            lines.append(
                f"{sample_name}{{{rendered}}} {value!r}" if labels else f"{sample_name} {value!r}"
            )
    return "\n".join(lines) + "\n"


def _escape(text: str, help_text: bool = False) -> str:
    text = text.replace("\\", "\\\\").replace("\n", "\\n")
    return text if help_text else text.replace('"', '\\"')
