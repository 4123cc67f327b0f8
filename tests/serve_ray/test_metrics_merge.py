"""The fleet's /metrics: the replicas' samples summed by name and labels."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from lora_guard.serve_ray.metrics import merge_metrics


def replica_text(lookups: dict[str, int], swaps: list[float], running: int) -> str:
    registry = CollectorRegistry()
    counter = Counter("lookups", "adapter lookups", ["result"], registry=registry)
    for result, n in lookups.items():
        counter.labels(result=result).inc(n)
    histogram = Histogram("swap_ms", "swap times", buckets=(1, 10), registry=registry)
    for value in swaps:
        histogram.observe(value)
    Gauge("running", 'requests "running"', registry=registry).set(running)
    return generate_latest(registry).decode()


def test_counters_histograms_and_gauges_add_up_over_replicas() -> None:
    merged = merge_metrics([replica_text({"hot": 3, "cold": 1}, [0.5, 5], 2),
                            replica_text({"hot": 1}, [20], 1)])  # fmt: skip
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(merged)
        for s in family.samples
    }
    assert samples["lookups_total", (("result", "hot"),)] == 4
    assert samples["lookups_total", (("result", "cold"),)] == 1
    assert samples["swap_ms_bucket", (("le", "1.0"),)] == 1
    assert samples["swap_ms_bucket", (("le", "+Inf"),)] == 3
    assert samples["swap_ms_count", ()] == 3
    assert samples["running", ()] == 3
    assert not any(name.endswith("_created") for name, _ in samples)
