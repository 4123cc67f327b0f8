"""Prometheus metrics of one engine, fed by the observer hooks (``docs/metrics.md``).

``MetricsPlugin`` is always on (plugin name ``metrics``). Each instance owns its own
:class:`prometheus_client.CollectorRegistry`, so several engines in one process never clash; the
server exposes :meth:`MetricsPlugin.render` at ``GET /metrics``.

The hooks run on the engine thread and only update counters and a few gauges; the two sliding
window ratios are computed when the metrics are collected.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

import pluggy
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from lora_guard.plugins import hookimpl
from lora_guard.plugins.options import OptionRegistry
from lora_guard.plugins.state import EngineState, RequestView

PLUGIN_NAME = "metrics"
DEFAULT_WINDOW_S = 60.0
SWAP_MS_BUCKETS = (0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 50.0, 100.0, 250.0, 500.0, 1000.0, 2000.0)
LOOKUP_RESULTS = ("hot", "warm", "cold")
COLD_LOAD_OUTCOMES = ("loaded", "rejected", "failed")


class SlidingRatio:
    """The share of events flagged True among those of the last ``window_s`` seconds.

    0.0 when the window holds no event (a number, never NaN, so alerts and dashboards need no
    special case). Thread-safe: the engine thread adds, the scrape thread reads.
    """

    def __init__(self, window_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.window_s = window_s
        self._clock = clock
        self._events: deque[tuple[float, bool]] = deque()
        self._flagged = 0
        self._lock = threading.Lock()

    def add(self, flagged: bool) -> None:
        now = self._clock()
        with self._lock:
            self._events.append((now, flagged))
            self._flagged += flagged
            self._trim(now)

    def value(self) -> float:
        with self._lock:
            self._trim(self._clock())
            return self._flagged / len(self._events) if self._events else 0.0

    def _trim(self, now: float) -> None:
        horizon = now - self.window_s
        events = self._events
        while events and events[0][0] < horizon:
            self._flagged -= events.popleft()[1]


class MetricsPlugin:
    """Counts adapter lookups, swaps, cold loads, prefix-cache hits and conflicts, and mirrors the
    engine's state (resident adapters, KV pool use, queue sizes) after every step."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, window_s: float = DEFAULT_WINDOW_S) -> None:
        self.registry = CollectorRegistry()
        self.pinned: frozenset[str] = frozenset()
        self.hot_window = SlidingRatio(window_s)
        self.cold_window = SlidingRatio(window_s)
        self._last_kv_conflicts = 0
        self._last_cached_tokens = 0
        self._last_preemptions = 0
        self._last_changed_on_disk = 0
        self._resident_key: tuple[Any, ...] | None = None
        self._resident: set[tuple[str, str, str]] = set()
        self._lora_info: tuple[str, str, str] | None = None
        reg = self.registry

        self.hot_adapter_hit_rate = Gauge(
            "lora_guard_hot_adapter_hit_rate",
            "Share of adapter lookups that found the adapter in a device slot, over the sliding "
            "window (metrics_window_s); 0 when there were no lookups.",
            registry=reg,
        )
        self.hot_adapter_hit_rate.set_function(self.hot_window.value)
        self.adapter_lookups = Counter(
            "lora_guard_adapter_lookups_total",
            "Adapter lookups by where the adapter was: hot (device slot), warm (host memory), "
            "cold (disk).",
            ["result"],
            registry=reg,
        )
        self.adapter_swap_ms = Histogram(
            "lora_guard_adapter_swap_ms",
            "Milliseconds an adapter load took: the read from disk (on the loader thread) plus "
            "the copy into the cache pool.",
            buckets=SWAP_MS_BUCKETS,
            registry=reg,
        )
        self.adapter_wait_ms = Histogram(
            "lora_guard_adapter_wait_ms",
            "Milliseconds from when a request first needed its adapter (at admission, or when "
            "parked) to when it was usable; 0 when it was resident.",
            buckets=(0, *SWAP_MS_BUCKETS),
            registry=reg,
        )
        self.cache_pool_bytes = Gauge(
            "lora_guard_cache_pool_bytes",
            "Bytes of the one cache pool by kind: kv (blocks in use), adapter (adapter pages), "
            "free.",
            ["kind"],
            registry=reg,
        )
        self.adapters_changed_on_disk = Counter(
            "lora_guard_adapter_changed_on_disk_total",
            "Adapters read again because their files changed on disk since they were read "
            "(new requests get the new weights; running ones finish under the old).",
            registry=reg,
        )
        self.requests_parked = Gauge(
            "lora_guard_requests_parked",
            "Running requests waiting, KV kept, for their adapter to come back into the pool.",
            registry=reg,
        )
        self.cold_loads = Counter(
            "lora_guard_cold_loads_total",
            "Cold adapter loads: loaded into a slot, rejected by a policy (busy, retry later), "
            "or failed (corrupt, missing or refused files).",
            ["outcome"],
            registry=reg,
        )
        self.cold_load_fail_ratio = Gauge(
            "lora_guard_cold_load_fail_ratio",
            "(rejected + failed) / (loaded + rejected + failed) cold loads over the sliding "
            "window; 0 when there were none.",
            registry=reg,
        )
        self.cold_load_fail_ratio.set_function(self.cold_window.value)
        self.kv_namespace_conflicts = Counter(
            "lora_guard_kv_namespace_conflict_total",
            "Prefix-cache blocks that matched a request's namespace and tokens but were computed "
            "under other weights.",
            registry=reg,
        )
        self.prefix_cache_hit_tokens = Counter(
            "lora_guard_prefix_cache_hit_tokens_total",
            "Prompt tokens served from the prefix cache.",
            registry=reg,
        )
        self.adapter_resident = Gauge(
            "lora_guard_adapter_resident",
            "1 for each adapter in the cache pool (tier=device) or only in host memory "
            "(tier=host).",
            ["adapter_id", "tier", "pinned"],
            registry=reg,
        )
        self.memory_watermark = Gauge(
            "lora_guard_memory_watermark",
            "Share of the cache pool in use (KV blocks and adapter pages), 0 to 1.",
            registry=reg,
        )
        # vLLM's names, for routers that already read them.
        self.vllm_lora_requests_info = Gauge(
            "vllm:lora_requests_info",
            "Running stats on LoRA requests (value: time of the last update, Unix seconds).",
            ["running_lora_adapters", "waiting_lora_adapters", "max_lora"],
            registry=reg,
        )
        self.vllm_num_requests_running = Gauge(
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
            registry=reg,
        )
        self.vllm_num_requests_waiting = Gauge(
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed.",
            registry=reg,
        )
        self.vllm_num_preemptions = Counter(
            "vllm:num_preemptions",
            "Running requests preempted because the KV pool was full (recomputed later).",
            registry=reg,
        )
        self.vllm_kv_cache_usage_perc = Gauge(
            "vllm:kv_cache_usage_perc",
            "KV-cache usage: the share of the cache pool held by KV blocks in use. 1 means 100 "
            "percent usage.",
            registry=reg,
        )
        # TGI's names, for existing dashboards. TGI's counters carry no _total suffix, which
        # prometheus_client adds to every Counter; these are gauges that only ever go up.
        self.tgi_request_count = Gauge(
            "tgi_request_count", "Requests finished (a counter).", registry=reg
        )
        self.tgi_request_success = Gauge(
            "tgi_request_success", "Requests that ended with generated text (a counter).",
            registry=reg,
        )  # fmt: skip
        self.tgi_request_failure = Gauge(
            "tgi_request_failure", "Requests that failed, by reason (a counter).", ["err"],
            registry=reg,
        )  # fmt: skip
        self.tgi_request_duration = Histogram(
            "tgi_request_duration", "Seconds from arrival to the end of the request.",
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120), registry=reg,
        )  # fmt: skip
        self.tgi_request_input_length = Histogram(
            "tgi_request_input_length", "Prompt tokens per request.",
            buckets=(16, 64, 256, 1024, 4096, 16384), registry=reg,
        )  # fmt: skip
        self.tgi_request_generated_tokens = Histogram(
            "tgi_request_generated_tokens", "Generated tokens per request.",
            buckets=(1, 16, 64, 256, 1024, 4096), registry=reg,
        )  # fmt: skip
        self.tgi_queue_size = Gauge("tgi_queue_size", "Requests waiting.", registry=reg)
        self.tgi_batch_current_size = Gauge(
            "tgi_batch_current_size", "Requests in the running batch.", registry=reg
        )
        # Show every labelled series from the start, at zero.
        for result in LOOKUP_RESULTS:
            self.adapter_lookups.labels(result=result)
        for outcome in COLD_LOAD_OUTCOMES:
            self.cold_loads.labels(outcome=outcome)

    # exposition

    def render(self) -> bytes:
        """The Prometheus text exposition of this engine's metrics."""
        return generate_latest(self.registry)

    # start-up

    @hookimpl
    def lora_guard_add_options(self, options: OptionRegistry) -> None:
        options.add(
            "metrics_window_s",
            float,
            self.hot_window.window_s,
            "seconds of history behind lora_guard_hot_adapter_hit_rate and "
            "lora_guard_cold_load_fail_ratio",
        )

    @hookimpl
    def lora_guard_configure(self, config: dict[str, Any]) -> None:
        window_s = float(config.get("metrics_window_s", self.hot_window.window_s))
        if not window_s > 0:
            raise ValueError(f"metrics_window_s must be positive, got {window_s}")
        self.hot_window.window_s = self.cold_window.window_s = window_s
        self.set_pinned(_id_list(config.get("pin")))

    def set_pinned(self, adapter_ids: Iterable[str]) -> None:
        """Adapters reported with ``pinned="true"`` (from the next step on)."""
        self.pinned = frozenset(adapter_ids)

    # observers

    @hookimpl
    def lora_guard_adapter_lookup(self, result: str) -> None:
        self.adapter_lookups.labels(result=result).inc()
        self.hot_window.add(result == "hot")

    @hookimpl
    def lora_guard_adapter_loaded(self, tier: str, swap_ms: float) -> None:
        self.adapter_swap_ms.observe(swap_ms)
        if tier == "cold":
            self.cold_loads.labels(outcome="loaded").inc()
            self.cold_window.add(False)

    @hookimpl
    def lora_guard_adapter_ready(self, wait_ms: float) -> None:
        self.adapter_wait_ms.observe(wait_ms)

    @hookimpl
    def lora_guard_adapter_load_failed(self) -> None:
        self.cold_loads.labels(outcome="failed").inc()
        self.cold_window.add(True)

    @hookimpl
    def lora_guard_request_finished(
        self, request: RequestView, finish_reason: str, retry_after: float | None
    ) -> None:
        if retry_after is not None:
            self.cold_loads.labels(outcome="rejected").inc()
            self.cold_window.add(True)
        self.tgi_request_count.inc()
        if finish_reason in ("error", "abort"):
            reason = "overloaded" if retry_after is not None else finish_reason
            self.tgi_request_failure.labels(err=reason).inc()
        else:
            self.tgi_request_success.inc()
        self.tgi_request_duration.observe(max(time.monotonic() - request.arrival_time, 0.0))
        self.tgi_request_input_length.observe(request.num_prompt_tokens)
        self.tgi_request_generated_tokens.observe(request.num_output_tokens)

    @hookimpl
    def lora_guard_step_finished(
        self, state: EngineState, kv_conflicts: int, cached_tokens: int
    ) -> None:
        self._last_kv_conflicts = _advance(
            self.kv_namespace_conflicts, self._last_kv_conflicts, kv_conflicts
        )
        self._last_cached_tokens = _advance(
            self.prefix_cache_hit_tokens, self._last_cached_tokens, cached_tokens
        )
        self._last_preemptions = _advance(
            self.vllm_num_preemptions, self._last_preemptions, state.num_preemptions
        )
        self.memory_watermark.set(state.memory_watermark)
        self.vllm_kv_cache_usage_perc.set(state.kv_share)
        self.vllm_num_requests_running.set(state.num_running)
        self.vllm_num_requests_waiting.set(state.num_waiting)
        self.tgi_queue_size.set(state.num_waiting)
        self.tgi_batch_current_size.set(state.num_running)
        for kind, nbytes in state.pool_bytes.items():
            self.cache_pool_bytes.labels(kind=kind).set(nbytes)
        self.requests_parked.set(state.num_parked)
        self._last_changed_on_disk = _advance(
            self.adapters_changed_on_disk,
            self._last_changed_on_disk,
            state.adapters_changed_on_disk,
        )
        self._update_resident(state)
        self._update_lora_info(state)

    def _update_resident(self, state: EngineState) -> None:
        device = tuple(v.adapter_id for v in state.slots)
        key = (device, state.host_adapters, self.pinned)
        if key == self._resident_key:
            return
        self._resident_key = key
        in_slots = {a for a in device if a is not None}
        resident = {(a, "device", self._pin_label(a)) for a in in_slots}
        resident.update(
            (a, "host", self._pin_label(a)) for a in state.host_adapters if a not in in_slots
        )
        for labels in resident - self._resident:
            self.adapter_resident.labels(*labels).set(1)
        for labels in self._resident - resident:
            self.adapter_resident.remove(*labels)
        self._resident = resident

    def _pin_label(self, adapter_id: str) -> str:
        return "true" if adapter_id in self.pinned else "false"

    def _update_lora_info(self, state: EngineState) -> None:
        labels = (
            ",".join(sorted(set(state.running_adapters))),
            ",".join(sorted(set(state.waiting_adapters))),
            str(len(state.slots)),
        )
        self.vllm_lora_requests_info.labels(*labels).set_to_current_time()
        if labels != self._lora_info:
            if self._lora_info is not None:
                self.vllm_lora_requests_info.remove(*self._lora_info)
            self._lora_info = labels


def metrics_of(pm: pluggy.PluginManager) -> MetricsPlugin | None:
    """The engine's metrics plugin, or None when it was disabled (``--disable-plugin metrics``)."""
    plugin = pm.get_plugin(PLUGIN_NAME)
    return plugin if isinstance(plugin, MetricsPlugin) else None


def _advance(counter: Counter, last: int, total: int) -> int:
    """Add to ``counter`` what a cumulative ``total`` grew by since ``last``; returns ``total``.
    A total that went down was reset at the source and counts from zero."""
    delta = total - last if total >= last else total
    if delta > 0:
        counter.inc(delta)
    return total


def _id_list(value: Any) -> list[str]:
    """Adapter ids from a setting: a list, or a comma-separated string."""
    if not value:
        return []
    if isinstance(value, str):
        return [v.strip() for v in value.split(",") if v.strip()]
    return [str(v) for v in value]
