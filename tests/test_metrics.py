"""The metrics plugin, fed by the real engine on the tiny model with real PEFT adapters."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from lora_guard import LLM, SamplingParams
from lora_guard.demo.testing import AdapterFactory
from lora_guard.metric_table import METRICS, Metric
from lora_guard.metrics import MetricsPlugin, metrics_of
from lora_guard.plugins import Reject, hookimpl
from lora_guard.plugins.state import EngineState, RequestView

PARAMS = SamplingParams(max_new_tokens=4, ignore_eos=True)
LONG_PROMPT = (
    "System: you are a helpful assistant that answers briefly. The capital of France is Paris, "
    "the capital of Italy is Rome and the capital of Spain is Madrid. User: and Portugal?"
)


@pytest.fixture(scope="module")
def adapters(tiny_adapters: AdapterFactory) -> dict[str, Path]:
    return tiny_adapters(n=3, prefix="m", strength=0.5)


def _llm(
    tiny_model: Path, adapters: dict[str, Path], settings: dict[str, object] | None = None
) -> LLM:
    return LLM(
        tiny_model,
        adapters=dict(adapters),
        kv_cache_memory="4MiB",
        max_loras=2,
        policies=(),
        settings=settings,
    )


def _metrics(llm: LLM) -> MetricsPlugin:
    plugin = metrics_of(llm.engine.hooks.pm)
    assert plugin is not None
    return plugin


def _samples(llm: LLM) -> list[Sample]:
    text = _metrics(llm).render().decode()
    return [s for family in text_string_to_metric_families(text) for s in family.samples]


def _value(samples: list[Sample], name: str, **labels: str) -> float:
    found = [s.value for s in samples if s.name == name and s.labels == labels]
    assert len(found) == 1, f"{name}{labels}: {len(found)} samples"
    return found[0]


def _labelsets(samples: list[Sample], name: str) -> list[dict[str, str]]:
    return [s.labels for s in samples if s.name == name]


def _generate(llm: LLM, adapter_ids: list[str | None], prompt: str = "Hello there") -> None:
    outs = llm.generate([prompt] * len(adapter_ids), PARAMS, adapter_ids)
    assert all(o.finish_reason == "length" for o in outs), [o.error for o in outs]


def test_a_workload_shows_in_the_metrics(tiny_model: Path, adapters: dict[str, Path]) -> None:
    a, b, c = sorted(adapters)
    llm = _llm(tiny_model, adapters, settings={"pin": [a]})
    batches: list[list[str | None]] = [[None, a, b, a], [c, a, None], [b, c, c]]
    for batch in batches:
        _generate(llm, batch)
    s = _samples(llm)
    lookups = {
        r: _value(s, "lora_guard_adapter_lookups_total", result=r) for r in ("hot", "warm", "cold")
    }
    requests = sum(1 for batch in batches for x in batch if x is not None)
    assert sum(lookups.values()) == requests
    assert lookups["cold"] >= 3 and lookups["hot"] >= 1
    stats = llm.engine.adapters.stats
    assert _value(s, "lora_guard_adapter_swap_ms_count") == stats.loads
    assert _value(s, "lora_guard_adapter_swap_ms_sum") == pytest.approx(sum(stats.swap_ms))
    assert _value(s, "lora_guard_cold_loads_total", outcome="loaded") == lookups["cold"] == 3
    assert _value(s, "lora_guard_cold_loads_total", outcome="failed") == 0
    assert _value(s, "lora_guard_cold_load_fail_ratio") == 0

    rate = _value(s, "lora_guard_hot_adapter_hit_rate")
    assert 0 < rate < 1
    assert rate == pytest.approx(lookups["hot"] / sum(lookups.values()))

    in_slots = {entry.adapter_id for entry in llm.engine.adapters.residents()}
    in_host = set(llm.engine.adapters.host.entries) - in_slots
    resident = _labelsets(s, "lora_guard_adapter_resident")
    assert {r["adapter_id"] for r in resident if r["tier"] == "device"} == in_slots
    assert {r["adapter_id"] for r in resident if r["tier"] == "host"} == in_host
    assert len(resident) == len(in_slots) + len(in_host)
    assert all(r["pinned"] == ("true" if r["adapter_id"] == a else "false") for r in resident)

    assert _value(s, "vllm:num_requests_running") == 0
    assert _value(s, "vllm:num_requests_waiting") == 0
    # Every request's first token came before its end: TTFT counted once each, under the duration.
    total = sum(len(batch) for batch in batches)
    assert _value(s, "vllm:time_to_first_token_seconds_count") == total
    ttft, duration = (
        _value(s, f"{name}_sum")
        for name in ("vllm:time_to_first_token_seconds", "tgi_request_duration")
    )
    assert 0 < ttft < duration
    # Idle: no KV block in use; the pool holds only the resident adapters' pages.
    assert _value(s, "vllm:kv_cache_usage_perc") == 0
    pool = {k: _value(s, "lora_guard_cache_pool_bytes", kind=k) for k in ("kv", "adapter", "free")}
    assert pool["kv"] == 0 and pool["adapter"] > 0
    assert _value(s, "lora_guard_memory_watermark") == pool["adapter"] / sum(pool.values())
    info = _labelsets(s, "vllm:lora_requests_info")
    # Idle: both seats hold an adapter; the one not pinned may leave for free, a third seat.
    assert len(info) == 1 and info[0]["max_lora"] == "3"
    assert info[0]["running_lora_adapters"] == ",".join(sorted(in_slots))
    assert info[0]["waiting_lora_adapters"] == ""
    assert set(info[0]) == {"running_lora_adapters", "waiting_lora_adapters", "max_lora"}
    llm.engine.check_no_leaks()


def test_a_repeated_prompt_counts_prefix_cache_hits(
    tiny_model: Path, adapters: dict[str, Path]
) -> None:
    llm = _llm(tiny_model, adapters)
    _generate(llm, [None], LONG_PROMPT)
    before = _value(_samples(llm), "lora_guard_prefix_cache_hit_tokens_total")
    _generate(llm, [None], LONG_PROMPT)
    after = _value(_samples(llm), "lora_guard_prefix_cache_hit_tokens_total")
    assert after > before
    assert after == llm.engine.blocks.stats.hit_tokens
    assert _value(_samples(llm), "lora_guard_kv_namespace_conflict_total") == 0


def test_a_corrupt_adapter_counts_as_a_failed_cold_load(
    tiny_model: Path, adapters: dict[str, Path], tmp_path: Path
) -> None:
    good = sorted(adapters)[0]
    bad = tmp_path / "bad"
    shutil.copytree(adapters[good], bad)
    (bad / "adapter_model.safetensors").write_bytes(b"not a safetensors file" * 10)
    llm = _llm(tiny_model, {good: adapters[good], "bad": bad})
    _generate(llm, [good])
    out = llm.generate("Hello", PARAMS, "bad")[0]
    assert out.finish_reason == "error"
    s = _samples(llm)
    assert _value(s, "lora_guard_cold_loads_total", outcome="failed") == 1
    assert _value(s, "lora_guard_cold_loads_total", outcome="loaded") == 1
    assert _value(s, "lora_guard_cold_load_fail_ratio") == pytest.approx(0.5)
    llm.engine.check_no_leaks()


class _RejectCold:
    """A real policy plugin: cold adapters are busy, retry in a second."""

    @hookimpl
    def lora_guard_adapter_load(
        self, request: RequestView, tier: str, state: EngineState
    ) -> Reject | None:
        return Reject("cold loads are paused", 1.0) if tier == "cold" else None


def test_a_rejected_cold_load_is_counted(tiny_model: Path, adapters: dict[str, Path]) -> None:
    llm = _llm(tiny_model, adapters)
    llm.engine.hooks.pm.register(_RejectCold(), name="reject-cold")
    llm.engine.scheduler.reject_when_busy = True  # as a server's engine: busy answers fail
    out = llm.generate("Hello", PARAMS, sorted(adapters)[0])[0]
    assert out.retry_after == 1.0
    s = _samples(llm)
    assert _value(s, "lora_guard_cold_loads_total", outcome="rejected") == 1
    assert _value(s, "lora_guard_cold_load_fail_ratio") == 1


def test_two_engines_have_their_own_registries(tiny_model: Path, adapters: dict[str, Path]) -> None:
    one, two = _llm(tiny_model, adapters), _llm(tiny_model, adapters)
    assert _metrics(one) is not _metrics(two)
    assert _metrics(one).registry is not _metrics(two).registry
    _generate(one, [sorted(adapters)[0]])
    assert _value(_samples(one), "lora_guard_adapter_lookups_total", result="cold") == 1
    assert _value(_samples(two), "lora_guard_adapter_lookups_total", result="cold") == 0
    assert _metrics(one).content_type.startswith("text/plain")


def test_the_window_option_is_declared_and_applied(
    tiny_model: Path, adapters: dict[str, Path]
) -> None:
    llm = _llm(tiny_model, adapters, settings={"metrics_window_s": 5.0})
    assert "metrics_window_s" in llm.engine.hooks.options.options
    assert _metrics(llm).hot_window.window_s == 5.0
    assert _metrics(llm).cold_window.window_s == 5.0


def test_a_pin_made_at_run_time_shows_in_the_label_from_the_next_step(
    tiny_model: Path, adapters: dict[str, Path]
) -> None:
    a, b, _ = sorted(adapters)
    llm = _llm(tiny_model, adapters, settings={"pin": [a]})
    _generate(llm, [a, b])
    llm.engine.adapters.usage.unpin(a)  # what the admin route calls, on the engine thread
    llm.engine.adapters.usage.pin(b)
    _generate(llm, [b])
    pinned = {
        r["adapter_id"]: r["pinned"]
        for r in _labelsets(_samples(llm), "lora_guard_adapter_resident")
    }
    assert pinned == {a: "false", b: "true"}


class _KeepOrder:
    """A real batch-form plugin that keeps the engine's order (it only reads the state)."""

    @hookimpl
    def lora_guard_batch_form(self, state: EngineState) -> list[str] | None:
        return None


def test_gauges_are_fresh_after_a_batch_with_a_deciding_plugin(
    tiny_model: Path, adapters: dict[str, Path]
) -> None:
    llm = _llm(tiny_model, adapters)
    llm.engine.hooks.pm.register(_KeepOrder(), name="keep-order")
    _generate(llm, [None, None])
    s = _samples(llm)
    assert _value(s, "vllm:num_requests_running") == 0
    assert _value(s, "lora_guard_memory_watermark") == 0


def _exposed(metric: Metric) -> str:
    """The name a metric shows under: prometheus_client gives every counter a _total suffix."""
    return (
        metric.name.removesuffix("_total") + "_total" if metric.kind == "counter" else metric.name
    )


def _documented_metrics() -> dict[str, tuple[str, str]]:
    """``docs/metrics.md``'s table rows: exposed name -> (type, labels column)."""
    docs = (Path(__file__).parents[1] / "docs" / "metrics.md").read_text()
    rows = (re.match(r"\| `([^`]+)` \| (\w+) \|([^|]*)\|", line) for line in docs.splitlines())
    return {m[1]: (m[2], m[3].strip()) for m in rows if m}


def test_every_declared_metric_has_a_docs_row_of_its_kind_and_labels() -> None:
    documented = _documented_metrics()
    for metric in METRICS:
        name = _exposed(metric)
        assert name in documented, f"{name} has no row in docs/metrics.md"
        kind, labels = documented[name]
        assert kind == metric.kind, f"{name}: docs say {kind}, declared {metric.kind}"
        assert all(f"`{label}`" in labels for label in metric.labels), f"{name}: labels"
        assert bool(labels) == bool(metric.labels), f"{name}: labels"
    assert set(documented) == {_exposed(m) for m in METRICS}, "rows for undeclared metrics"
    text = MetricsPlugin().render().decode()  # the exposition is the table
    for metric in METRICS:
        assert f"# HELP {_exposed(metric)} {metric.help}\n" in text
