"""vllm:lora_requests_info shows which adapters run and which wait, while requests are in flight."""

from __future__ import annotations

from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from lora_guard import LLM, SamplingParams
from lora_guard.metrics import metrics_of
from lora_guard.testing import AdapterFactory


def test_running_and_waiting_adapters_are_listed(
    tiny_model: Path, tiny_adapters: AdapterFactory
) -> None:
    adapters = tiny_adapters(n=2, prefix="w")
    llm = LLM(tiny_model, adapters=adapters, kv_cache_memory="4MiB", max_num_seqs=1,
              policies="lru")  # fmt: skip
    engine = llm.engine
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    engine.add_request("first", "hello", params, "w-00")
    engine.add_request("second", "hello", params, "w-01")
    seen = set()
    while engine.has_unfinished_requests():
        engine.step()
        plugin = metrics_of(engine.hooks.pm)
        assert plugin is not None
        for family in text_string_to_metric_families(plugin.render().decode()):
            if family.name == "vllm:lora_requests_info" and family.samples:
                labels = family.samples[0].labels
                seen.add((labels["running_lora_adapters"], labels["waiting_lora_adapters"]))
    assert ("w-00", "w-01") in seen  # w-00 running while w-01 waits its turn
    assert ("w-01", "") in seen
    engine.check_no_leaks()
