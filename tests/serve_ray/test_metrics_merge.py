"""The fleet's /metrics: counters and histograms summed, ratios computed again from the summed
samples, every other gauge per replica."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from lora_guard.serve_ray.metrics import merge_metrics


def replica_text(
    lookups: dict[str, int],
    swaps: list[float],
    running: int,
    hit_rate: float,
    cold: dict[str, int],
    pool: dict[str, int],
) -> str:
    """A replica's text with the real metric names, as ``lora_guard.metrics`` writes them."""
    registry = CollectorRegistry()
    counter = Counter(
        "lora_guard_adapter_lookups", "adapter lookups", ["result"], registry=registry
    )
    for result, n in lookups.items():
        counter.labels(result=result).inc(n)
    loads = Counter("lora_guard_cold_loads", "cold loads", ["outcome"], registry=registry)
    for outcome, n in cold.items():
        loads.labels(outcome=outcome).inc(n)
    histogram = Histogram(
        "lora_guard_adapter_swap_ms", "swap times", buckets=(1, 10), registry=registry
    )
    for value in swaps:
        histogram.observe(value)
    Gauge("vllm:num_requests_running", 'requests "running"', registry=registry).set(running)
    Gauge("lora_guard_hot_adapter_hit_rate", "hit rate", registry=registry).set(hit_rate)
    Gauge("lora_guard_cold_load_fail_ratio", "fail ratio", registry=registry).set(0.5)
    Gauge("vllm:kv_cache_usage_perc", "kv share", registry=registry).set(0.9)
    Gauge("lora_guard_memory_watermark", "in use", registry=registry).set(0.9)
    kinds = Gauge("lora_guard_cache_pool_bytes", "pool", ["kind"], registry=registry)
    for kind, n in pool.items():
        kinds.labels(kind=kind).set(n)
    Gauge("tgi_request_failure", "failed", ["err"], registry=registry).labels(err="abort").set(2)
    return generate_latest(registry).decode()


def samples_of(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_fleet_figures_agree_with_the_replicas_own() -> None:
    """Two replicas with different hit rates (3 hot of 4 lookups, 0 of 4): the fleet's is the
    summed counters' 3/8, not 0.75 + 0.0; the fail ratio 1/4 from 1 rejected of 4 cold loads;
    the KV share from the pool's summed bytes; the running requests per replica."""
    merged = merge_metrics(
        {
            "r1": replica_text(
                {"hot": 3, "cold": 1},
                [0.5, 5],
                2,
                0.75,
                {"loaded": 1, "rejected": 1},
                {"kv": 60, "adapter": 20, "free": 20},
            ),
            "r2": replica_text(
                {"warm": 2, "cold": 2},
                [20],
                1,
                0.0,
                {"loaded": 2},
                {"kv": 10, "adapter": 30, "free": 60},
            ),
        }
    )
    samples = samples_of(merged)
    assert samples["lora_guard_adapter_lookups_total", (("result", "hot"),)] == 3
    assert samples["lora_guard_adapter_lookups_total", (("result", "cold"),)] == 3
    assert samples["lora_guard_adapter_swap_ms_bucket", (("le", "1.0"),)] == 1
    assert samples["lora_guard_adapter_swap_ms_bucket", (("le", "+Inf"),)] == 3
    assert samples["lora_guard_adapter_swap_ms_count", ()] == 3
    assert samples["lora_guard_hot_adapter_hit_rate", ()] == 3 / 8
    assert samples["lora_guard_cold_load_fail_ratio", ()] == 1 / 4
    assert samples["vllm:kv_cache_usage_perc", ()] == 70 / 200
    assert samples["lora_guard_memory_watermark", ()] == 120 / 200
    assert samples["tgi_request_failure", (("err", "abort"),)] == 4  # a count: summed
    assert samples["vllm:num_requests_running", (("replica", "r1"),)] == 2
    assert samples["vllm:num_requests_running", (("replica", "r2"),)] == 1
    assert ("vllm:num_requests_running", ()) not in samples
    assert samples["lora_guard_cache_pool_bytes", (("kind", "kv"), ("replica", "r2"))] == 10
    assert not any(name.endswith("_created") for name, _ in samples)


def test_ratios_stay_within_zero_and_one_for_any_number_of_replicas() -> None:
    replicas = {
        f"r{i}": replica_text(
            {"hot": 5}, [], 0, 1.0, {"rejected": 3}, {"kv": 1, "adapter": 1, "free": 0}
        )
        for i in range(5)
    }
    samples = samples_of(merge_metrics(replicas))
    for name in (
        "lora_guard_hot_adapter_hit_rate",
        "lora_guard_cold_load_fail_ratio",
        "vllm:kv_cache_usage_perc",
        "lora_guard_memory_watermark",
    ):
        assert 0 <= samples[name, ()] <= 1, name
    assert samples["lora_guard_hot_adapter_hit_rate", ()] == 1.0
    idle = samples_of(merge_metrics({"r0": replica_text({}, [], 0, 0.0, {}, {"free": 8})}))
    assert idle["lora_guard_hot_adapter_hit_rate", ()] == 0.0  # no lookups: 0, never NaN
