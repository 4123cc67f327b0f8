"""vllm:lora_requests_info shows which adapters are resident, which requests wait for, and the
room to load one, while requests are in flight."""

from __future__ import annotations

from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from lora_guard import LLM, SamplingParams
from lora_guard.demo.testing import AdapterFactory
from lora_guard.engine.llm_engine import LLMEngine
from lora_guard.metrics import metrics_of


def _labels(engine: LLMEngine) -> tuple[str, str, str]:
    plugin = metrics_of(engine.hooks.pm)
    assert plugin is not None
    for family in text_string_to_metric_families(plugin.render().decode()):
        if family.name == "vllm:lora_requests_info" and family.samples:
            labels = family.samples[0].labels
            return (
                labels["running_lora_adapters"],
                labels["waiting_lora_adapters"],
                labels["max_lora"],
            )
    raise AssertionError("vllm:lora_requests_info has no sample")


def test_resident_waiting_and_free_adapters_are_listed(
    tiny_model: Path, tiny_adapters: AdapterFactory
) -> None:
    adapters = tiny_adapters(n=2, prefix="w")
    llm = LLM(
        tiny_model,
        adapters=adapters,
        kv_cache_memory="4MiB",
        max_num_seqs=1,
        max_loras=2,
        policies="lru",
    )
    engine = llm.engine
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    engine.add_request("first", "hello", params, "w-00")
    engine.add_request("second", "hello", params, "w-01")
    seen = set()
    while engine.has_unfinished_requests():
        if engine.step():
            seen.add(_labels(engine))
    # w-00 runs while w-01 waits its turn with its adapter resident: both seats are needed, so
    # there is no room to load a third (2 + 0 is not below 2).
    assert ("w-00,w-01", "", "2") in seen
    # Done: both adapters stay resident and may leave for free, so each counts as a seat more.
    assert _labels(engine) == ("w-00,w-01", "", "4")
    engine.check_no_leaks()
