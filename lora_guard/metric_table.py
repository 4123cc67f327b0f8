"""The metrics lora-guard exposes, declared once (name, kind, help, labels, buckets): the plugin
that feeds them is ``lora_guard.metrics``, and ``docs/metrics.md`` has a row for each."""

from __future__ import annotations

from dataclasses import dataclass

SWAP_MS_BUCKETS = (0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 50.0, 100.0, 250.0, 500.0, 1000.0, 2000.0)
LOOKUP_RESULTS = ("hot", "warm", "cold")
COLD_LOAD_OUTCOMES = ("loaded", "rejected", "failed")


@dataclass(frozen=True, slots=True)
class Metric:
    """One row of the metrics table; ``docs/metrics.md`` has a row for each."""

    name: str
    kind: str  # counter, gauge or histogram
    help: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] = ()


# In the order of the exposition. TGI's counters carry no _total suffix, which prometheus_client
# adds to every Counter: they are gauges that only ever go up.
# one row a line, as a table reads (fmt: skip)
METRICS = (
    Metric("lora_guard_hot_adapter_hit_rate", "gauge",
           "Share of adapter lookups that found the adapter in a device slot, over the sliding "
           "window (metrics_window_s); 0 when there were no lookups."),
    Metric("lora_guard_adapter_lookups_total", "counter",
           "Adapter lookups by where the adapter was: hot (device slot), warm (host memory), "
           "cold (disk).", ("result",)),
    Metric("lora_guard_adapter_swap_ms", "histogram",
           "Milliseconds an adapter load took: the read from disk (on the loader thread) plus "
           "the copy into the cache pool.", buckets=SWAP_MS_BUCKETS),
    Metric("lora_guard_adapter_wait_ms", "histogram",
           "Milliseconds from when a request first needed its adapter (at admission, or when "
           "parked) to when it was usable; 0 when it was resident.",
           buckets=(0, *SWAP_MS_BUCKETS)),
    Metric("lora_guard_request_held_ms", "histogram",
           "Milliseconds a finished request spent waiting while a policy left it out of the "
           "batch (hot-set admission's hold-backs), beside its adapter wait.",
           buckets=(0, *SWAP_MS_BUCKETS, 5000.0, 10000.0)),
    Metric("lora_guard_cache_pool_bytes", "gauge",
           "Bytes of the one cache pool by kind: kv (blocks in use), adapter (adapter pages), "
           "free.", ("kind",)),
    Metric("lora_guard_adapter_changed_on_disk_total", "counter",
           "Adapters read again because their files changed on disk since they were read "
           "(new requests get the new weights; running ones finish under the old)."),
    Metric("lora_guard_requests_parked", "gauge",
           "Running requests waiting, KV kept, for their adapter to come back into the pool."),
    Metric("lora_guard_cold_loads_total", "counter",
           "Cold adapter loads: loaded into a slot, rejected by a policy (busy, retry later), "
           "or failed (corrupt, missing or refused files).", ("outcome",)),
    Metric("lora_guard_cold_load_fail_ratio", "gauge",
           "(rejected + failed) / (loaded + rejected + failed) cold loads over the sliding "
           "window; 0 when there were none."),
    Metric("lora_guard_kv_namespace_conflict_total", "counter",
           "Prefix-cache blocks that matched a request's namespace and tokens but were computed "
           "under other weights."),
    Metric("lora_guard_prefix_cache_hit_tokens_total", "counter",
           "Prompt tokens served from the prefix cache."),
    Metric("lora_guard_adapter_resident", "gauge",
           "1 for each adapter in the cache pool (tier=device) or only in host memory "
           "(tier=host).", ("adapter_id", "tier", "pinned")),
    Metric("lora_guard_memory_watermark", "gauge",
           "Share of the cache pool in use (KV blocks and adapter pages), 0 to 1."),
    # vLLM's names, for routers that already read them
    Metric("vllm:lora_requests_info", "gauge",
           "Running stats on LoRA requests (value: time of the last update, Unix seconds): the "
           "adapters resident, those requests wait for, and max_lora, the seats plus the resident "
           "adapters no request needs (running + waiting < max_lora: room to load one).",
           ("running_lora_adapters", "waiting_lora_adapters", "max_lora")),
    Metric("vllm:lora_adapter_loaded", "gauge",
           "1 for each adapter loaded: level=gpu in the cache pool, on the model's device, ready "
           "to serve; level=cpu only in host memory. pinned: exempt from eviction; rank: its "
           "largest rank.", ("adapter_name", "level", "pinned", "rank")),
    Metric("vllm:num_gpu_loaded_lora_adapters", "gauge",
           "Adapters in the cache pool; model_name is the served base model.", ("model_name",)),
    Metric("vllm:num_cpu_loaded_lora_adapters", "gauge",
           "Adapters in host memory (those in the pool included).", ("model_name",)),
    Metric("vllm:max_gpu_lora_adapters", "gauge",
           "Adapters the cache pool can hold now: max_loras; without a seat cap, those in it "
           "plus as many more as its free pages hold, at the largest size it has seen.",
           ("model_name",)),
    Metric("vllm:lora_adapter_load_seconds", "histogram",
           "Seconds an adapter transition took: load (read from disk into host memory), "
           "activate (copy from host memory into the cache pool).", ("transition",),
           buckets=tuple(ms / 1000 for ms in SWAP_MS_BUCKETS)),
    Metric("vllm:num_requests_running", "gauge", "Number of requests in model execution batches."),
    Metric("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed."),
    Metric("vllm:num_preemptions", "counter",
           "Running requests preempted because the KV pool was full (recomputed later)."),
    Metric("vllm:time_to_first_token_seconds", "histogram",
           "Seconds from a request's arrival to its first generated token.",
           buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 7.5, 10, 20, 40, 80)),
    Metric("vllm:kv_cache_usage_perc", "gauge",
           "KV-cache usage: the share of the cache pool held by KV blocks in use. 1 means 100 "
           "percent usage."),
    # TGI's names, for existing dashboards
    Metric("tgi_request_count", "gauge", "Requests finished (a counter)."),
    Metric("tgi_request_success", "gauge", "Requests that ended with generated text (a counter)."),
    Metric("tgi_request_failure", "gauge", "Requests that failed, by reason (a counter).",
           ("err",)),
    Metric("tgi_request_duration", "histogram", "Seconds from arrival to the end of the request.",
           buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)),
    Metric("tgi_request_input_length", "histogram", "Prompt tokens per request.",
           buckets=(16, 64, 256, 1024, 4096, 16384)),
    Metric("tgi_request_generated_tokens", "histogram", "Generated tokens per request.",
           buckets=(1, 16, 64, 256, 1024, 4096)),
    Metric("tgi_queue_size", "gauge", "Requests waiting."),
    Metric("tgi_batch_current_size", "gauge", "Requests in the running batch."),
)  # fmt: skip
