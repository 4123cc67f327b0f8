"""Prometheus metrics of one engine, fed by the observer hooks (``docs/metrics.md``).

``MetricsPlugin`` is always on (plugin name ``metrics``). Each instance owns its own
:class:`prometheus_client.CollectorRegistry`, so several engines in one process never clash; the
server exposes :meth:`MetricsPlugin.render` at ``GET /metrics``.

The metrics are declared once, in :data:`lora_guard.metric_table.METRICS` (name, kind, help,
labels, buckets). The hooks run on the engine thread and only update counters and a few gauges;
the two sliding-window ratios are computed when the metrics are collected. The ``pinned`` label
reads the engine's pins from the state view.
"""

from __future__ import annotations

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

from lora_guard.engine.usage import SlidingWindow
from lora_guard.metric_table import (
    COLD_LOAD_OUTCOMES,
    LOOKUP_RESULTS,
    METRICS,
)
from lora_guard.plugins import hookimpl
from lora_guard.plugins.options import OptionRegistry
from lora_guard.plugins.state import EngineState, RequestView

PLUGIN_NAME = "metrics"
DEFAULT_WINDOW_S = 60.0


class MetricsPlugin:
    """Counts adapter lookups, swaps, cold loads, prefix-cache hits and conflicts, and mirrors the
    engine's state (resident adapters, KV pool use, queue sizes) after every step."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, window_s: float = DEFAULT_WINDOW_S) -> None:
        self.registry = reg = CollectorRegistry()
        self.hot_window: SlidingWindow[bool] = SlidingWindow(window_s)  # True: a hot lookup
        self.cold_window: SlidingWindow[bool] = SlidingWindow(window_s)  # True: rejected, failed
        self._last_kv_conflicts = 0
        self._last_cached_tokens = 0
        self._last_preemptions = 0
        self._last_changed_on_disk = 0
        self._resident_key: tuple[Any, ...] | None = None
        self._loaded: set[tuple[str, ...]] = set()
        self.max_loras = 0
        self.model_name = ""  # the served base model, set by the server once it is known
        self._counted_model = ""
        self._resident: set[tuple[str, ...]] = set()
        self._lora_info: tuple[str, str, str] | None = None
        self.counter: dict[str, Counter] = {}
        self.gauge: dict[str, Gauge] = {}
        self.histogram: dict[str, Histogram] = {}
        for m in METRICS:  # one pass: the exposition keeps the table's order
            if m.kind == "counter":
                self.counter[m.name] = Counter(m.name, m.help, m.labels, registry=reg)
            elif m.kind == "gauge":
                self.gauge[m.name] = Gauge(m.name, m.help, m.labels, registry=reg)
            else:
                self.histogram[m.name] = Histogram(
                    m.name, m.help, m.labels, buckets=m.buckets, registry=reg
                )
        self.gauge["lora_guard_hot_adapter_hit_rate"].set_function(
            lambda: self.hot_window.share(True)
        )
        self.gauge["lora_guard_cold_load_fail_ratio"].set_function(
            lambda: self.cold_window.share(True)
        )
        # Show every labelled series from the start, at zero.
        for result in LOOKUP_RESULTS:
            self.counter["lora_guard_adapter_lookups_total"].labels(result=result)
        for outcome in COLD_LOAD_OUTCOMES:
            self.counter["lora_guard_cold_loads_total"].labels(outcome=outcome)
        for transition in ("load", "activate"):
            self.histogram["vllm:lora_adapter_load_seconds"].labels(transition=transition)

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
        self.max_loras = int(config.get("max_loras", 0) or 0)

    # observers

    @hookimpl
    def lora_guard_adapter_lookup(self, result: str) -> None:
        self.counter["lora_guard_adapter_lookups_total"].labels(result=result).inc()
        self.hot_window.add(result == "hot")

    @hookimpl
    def lora_guard_adapter_loaded(self, tier: str, swap_ms: float, read_ms: float) -> None:
        self.histogram["lora_guard_adapter_swap_ms"].observe(swap_ms)
        transitions = self.histogram["vllm:lora_adapter_load_seconds"]
        if tier == "cold" and read_ms > 0:
            transitions.labels(transition="load").observe(read_ms / 1000)
        transitions.labels(transition="activate").observe(max(swap_ms - read_ms, 0.0) / 1000)
        if tier == "cold":
            self._cold_load("loaded")

    @hookimpl
    def lora_guard_adapter_ready(self, wait_ms: float) -> None:
        self.histogram["lora_guard_adapter_wait_ms"].observe(wait_ms)

    @hookimpl
    def lora_guard_adapter_load_failed(self) -> None:
        self._cold_load("failed")

    @hookimpl
    def lora_guard_request_finished(
        self, request: RequestView, finish_reason: str, retry_after: float | None
    ) -> None:
        if retry_after is not None:
            self._cold_load("rejected")
        self.gauge["tgi_request_count"].inc()
        if finish_reason in ("error", "abort"):
            reason = "overloaded" if retry_after is not None else finish_reason
            self.gauge["tgi_request_failure"].labels(err=reason).inc()
        else:
            self.gauge["tgi_request_success"].inc()
        end = request.finished_time if request.finished_time is not None else request.arrival_time
        duration_s = max(end - request.arrival_time, 0.0)
        self.histogram["tgi_request_duration"].observe(duration_s)
        self.histogram["lora_guard_request_held_ms"].observe(request.held_s * 1000)
        if request.first_token_time is not None:
            ttft_s = max(request.first_token_time - request.arrival_time, 0.0)
            self.histogram["vllm:time_to_first_token_seconds"].observe(ttft_s)
        self.histogram["tgi_request_input_length"].observe(request.num_prompt_tokens)
        self.histogram["tgi_request_generated_tokens"].observe(request.num_output_tokens)

    def _cold_load(self, outcome: str) -> None:
        self.counter["lora_guard_cold_loads_total"].labels(outcome=outcome).inc()
        self.cold_window.add(outcome != "loaded")

    @hookimpl
    def lora_guard_step_finished(
        self, state: EngineState, kv_conflicts: int, cached_tokens: int
    ) -> None:
        self._last_kv_conflicts = self._advance(
            "lora_guard_kv_namespace_conflict_total", self._last_kv_conflicts, kv_conflicts
        )
        self._last_cached_tokens = self._advance(
            "lora_guard_prefix_cache_hit_tokens_total", self._last_cached_tokens, cached_tokens
        )
        self._last_preemptions = self._advance(
            "vllm:num_preemptions", self._last_preemptions, state.num_preemptions
        )
        self._last_changed_on_disk = self._advance(
            "lora_guard_adapter_changed_on_disk_total",
            self._last_changed_on_disk,
            state.adapters_changed_on_disk,
        )
        self.publish(state)

    def publish(self, state: EngineState) -> None:
        """Mirror ``state`` in the gauges: after every step, and once at start (routers read
        the residency gauges before any request)."""
        gauge = self.gauge
        gauge["lora_guard_memory_watermark"].set(state.memory_watermark)
        gauge["vllm:kv_cache_usage_perc"].set(state.kv_share)
        gauge["vllm:num_requests_running"].set(state.num_running)
        gauge["vllm:num_requests_waiting"].set(state.num_waiting)
        gauge["tgi_queue_size"].set(state.num_waiting)
        gauge["tgi_batch_current_size"].set(state.num_running)
        for kind, nbytes in state.pool_bytes.items():
            gauge["lora_guard_cache_pool_bytes"].labels(kind=kind).set(nbytes)
        gauge["lora_guard_requests_parked"].set(state.num_parked)
        self._update_resident(state)
        self._update_loaded(state)
        self._update_lora_info(state)

    def _advance(self, name: str, last: int, total: int) -> int:
        """Add to counter ``name`` what a cumulative ``total`` grew by since ``last``; returns
        ``total``. A total that went down was reset at the source and counts from zero."""
        delta = total - last if total >= last else total
        if delta > 0:
            self.counter[name].inc(delta)
        return total

    def _update_resident(self, state: EngineState) -> None:
        device = tuple(v.adapter_id for v in state.slots)
        key = (device, state.host_adapters, state.pinned)
        if key == self._resident_key:
            return
        self._resident_key = key

        def labels(adapter_id: str, tier: str) -> tuple[str, ...]:
            return adapter_id, tier, "true" if adapter_id in state.pinned else "false"

        in_slots = {a for a in device if a is not None}
        resident = {labels(a, "device") for a in in_slots}
        resident.update(labels(a, "host") for a in state.host_adapters if a not in in_slots)
        self._resident = present(
            self.gauge["lora_guard_adapter_resident"], self._resident, resident
        )

    def _update_loaded(self, state: EngineState) -> None:
        """vLLM's residency gauges, as routers read them (llm-d's load-state scorer)."""
        in_pool = {v.adapter_id for v in state.slots if v.adapter_id is not None}

        def series(adapter_id: str, level: str) -> tuple[str, ...]:
            pinned = "true" if adapter_id in state.pinned else "false"
            return adapter_id, level, pinned, str(state.adapter_ranks.get(adapter_id, ""))

        loaded = {series(a, "gpu") for a in in_pool}
        loaded.update(series(a, "cpu") for a in state.host_adapters if a not in in_pool)
        self._loaded = present(self.gauge["vllm:lora_adapter_loaded"], self._loaded, loaded)
        counts = {
            "vllm:num_gpu_loaded_lora_adapters": len(in_pool),
            "vllm:num_cpu_loaded_lora_adapters": len(state.host_adapters),
            "vllm:max_gpu_lora_adapters": pool_capacity(state, self.max_loras),
        }
        renamed = self.model_name != self._counted_model
        for name, value in counts.items():
            if renamed:
                self.gauge[name].clear()  # named after the first steps: no series for ""
            self.gauge[name].labels(model_name=self.model_name).set(value)
        self._counted_model = self.model_name

    def _update_lora_info(self, state: EngineState) -> None:
        labels = lora_requests_labels(state)
        gauge = self.gauge["vllm:lora_requests_info"]
        gauge.labels(*labels).set_to_current_time()
        if labels != self._lora_info:
            if self._lora_info is not None:
                gauge.remove(*self._lora_info)
            self._lora_info = labels


def present(
    gauge: Gauge, shown: set[tuple[str, ...]], now: set[tuple[str, ...]]
) -> set[tuple[str, ...]]:
    """A gauge of one series at 1 for each label set in ``now``: those new are added, those gone
    removed (``shown``: the label sets shown so far). Returns ``now``."""
    for labels in now - shown:
        gauge.labels(*labels).set(1)
    for labels in shown - now:
        gauge.remove(*labels)
    return now


def pool_capacity(state: EngineState, max_loras: int) -> int:
    """Adapters the cache pool can hold now: its seats under a cap; without one, those in it plus
    as many more as its free pages hold at the largest size among those it knows."""
    if max_loras:
        return max_loras
    in_pool = sum(1 for v in state.slots if v.adapter_id is not None)
    largest = max(state.adapter_pages.values(), default=0)
    return in_pool + (state.free_pages // largest if largest else int(state.free_pages > 0))


def lora_requests_labels(state: EngineState) -> tuple[str, str, str]:
    """``vllm:lora_requests_info``'s labels as a gateway's endpoint picker reads them: it counts
    ``running + waiting < max_lora`` as room to load an adapter. Running: the adapters resident
    in the pool (a request for one is served without a load). Waiting: the adapters requests wait
    for that are not resident (loading, or waiting for a seat). ``max_lora``: the seats, plus the
    resident adapters that may leave now for free (no request needs them, not pinned), so that
    the inequality holds exactly when a load can take a seat without evicting an adapter that
    requests still need."""
    resident = {v.adapter_id for v in state.slots if v.adapter_id is not None}
    needed = set(state.running_adapters) | set(state.waiting_adapters)
    # Between steps the engine lets an adapter no request needs leave at once (the quantum holds
    # only needed ones); the state a step reports still counts its own batch as using them.
    idle = {
        v.adapter_id
        for v in state.slots
        if v.adapter_id is not None
        and v.adapter_id not in needed
        and v.adapter_id not in state.pinned
    }
    return (
        ",".join(sorted(resident)),
        ",".join(sorted(needed - resident)),
        str(len(state.slots) + len(idle)),
    )


def metrics_of(pm: pluggy.PluginManager) -> MetricsPlugin | None:
    """The engine's metrics plugin, or None when it was disabled (``--disable-plugin metrics``)."""
    plugin = pm.get_plugin(PLUGIN_NAME)
    return plugin if isinstance(plugin, MetricsPlugin) else None
