"""The fleet's ``/metrics``: every engine replica's Prometheus samples, summed by name and labels.

Counters and histograms add up to the fleet's (lookups, swaps, cold loads, conflicts), so
``lora-guard bench --target`` reads a fleet as it reads one server; gauges add up too (requests
running, bytes in use). ``_created`` timestamps are left out.
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client.parser import text_string_to_metric_families


def merge_metrics(texts: Iterable[str]) -> str:
    families: dict[str, tuple[str, str]] = {}  # name -> (type, help)
    samples: dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]] = {}
    for text in texts:
        for family in text_string_to_metric_families(text):
            families.setdefault(family.name, (family.type, family.documentation))
            rows = samples.setdefault(family.name, {})
            for sample in family.samples:
                if sample.name.endswith("_created"):
                    continue
                key = (sample.name, tuple(sorted(sample.labels.items())))
                rows[key] = rows.get(key, 0.0) + sample.value
    lines = []
    for name, (kind, doc) in families.items():
        lines.append(f"# HELP {name} {_escape(doc, help_text=True)}")
        lines.append(f"# TYPE {name} {kind}")
        for (sample_name, labels), value in samples[name].items():
            rendered = ",".join(f'{k}="{_escape(v)}"' for k, v in labels)
            lines.append(f"{sample_name}{{{rendered}}} {value!r}" if labels
                         else f"{sample_name} {value!r}")  # fmt: skip
    return "\n".join(lines) + "\n"


def _escape(text: str, help_text: bool = False) -> str:
    text = text.replace("\\", "\\\\").replace("\n", "\\n")
    return text if help_text else text.replace('"', '\\"')
