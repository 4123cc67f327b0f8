"""Metrics a router reads, a client that disconnects mid-stream, and SIGTERM drain."""

from __future__ import annotations

import json
import re
import threading
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from lora_guard.demo.testing import ServerProcess as Server
from lora_guard.demo.testing import eventually, start_server

# one row a line, as a table reads (fmt: skip)
DESIGN_METRICS = [
    "lora_guard_hot_adapter_hit_rate", "lora_guard_adapter_lookups", "lora_guard_adapter_swap_ms",
    "lora_guard_cold_load_fail_ratio", "lora_guard_cold_loads", "lora_guard_kv_namespace_conflict",
    "lora_guard_prefix_cache_hit_tokens", "lora_guard_adapter_resident",
    "lora_guard_memory_watermark", "vllm:lora_requests_info", "vllm:num_requests_running",
    "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc", "tgi_request_count",
    "tgi_request_success", "tgi_request_duration", "tgi_request_input_length",
    "tgi_request_generated_tokens", "tgi_queue_size", "tgi_batch_current_size",
]  # fmt: skip


def samples(url: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    text = httpx.get(url + "/metrics").text
    found: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found.setdefault(family.name, []).append((sample.labels, sample.value))
    return found


def test_metrics_expose_every_design_name(server: Server) -> None:
    body = {"inputs": "hello", "parameters": {"max_new_tokens": 2, "adapter_id": "a-01"}}
    assert httpx.post(server.url + "/generate", json=body, timeout=60).status_code == 200
    found = samples(server.url)
    missing = [name for name in DESIGN_METRICS if name not in found]
    assert not missing, missing


def test_lora_requests_info_lists_running_adapters_in_flight(server: Server) -> None:
    seen: list[set[str]] = []  # the running label lists every adapter resident in the pool
    body = {"inputs": "hello", "parameters": {"max_new_tokens": 200, "adapter_id": "a-02"}}
    with httpx.stream("POST", server.url + "/generate_stream", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data:"):
                for labels, _ in samples(server.url)["vllm:lora_requests_info"]:
                    seen.append(set(labels["running_lora_adapters"].split(",")))
                break
    assert any("a-02" in running for running in seen)


def test_disconnect_mid_stream_frees_the_blocks(server: Server) -> None:
    body = {"inputs": "hello", "parameters": {"max_new_tokens": 300}}
    events = 0
    with httpx.stream("POST", server.url + "/generate_stream", json=body, timeout=60) as r:
        for line in r.iter_lines():
            events += line.startswith("data:")
            if events == 3:
                break  # the client goes away

    def freed() -> bool:
        found = samples(server.url)
        assert found["vllm:num_requests_running"][0][1] == 0
        assert found["vllm:kv_cache_usage_perc"][0][1] == 0
        return True

    eventually(freed, what="the request to end and its blocks to be freed")


def test_sigterm_drains_requests_in_flight_and_exits_zero(
    tiny: tuple[Path, Path], tmp_path: Path
) -> None:
    model, adapters = tiny
    log = tmp_path / "log"
    server = start_server(model, adapters, log=log)
    result: dict[str, object] = {}

    def long_request() -> None:
        body = {"inputs": "hello", "parameters": {"max_new_tokens": 60}}
        r = httpx.post(server.url + "/generate", json=body, timeout=60)
        result["status"], result["body"] = r.status_code, r.json()

    worker = threading.Thread(target=long_request)
    worker.start()
    time.sleep(0.5)  # the request is running
    assert server.stop(timeout=60) == 0, log.read_text()
    worker.join(60)
    assert result["status"] == 200, result
    assert result["body"]["details"]["generated_tokens"] == 60  # type: ignore[index]
    # New connections are refused once it has stopped.
    try:
        httpx.get(server.url + "/health", timeout=2)
        refused = False
    except httpx.ConnectError:
        refused = True
    assert refused
    assert re.search(r"Shutting down|Finished server process", log.read_text())
    json.dumps(result)
