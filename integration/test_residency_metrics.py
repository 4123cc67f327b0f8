"""vLLM's residency gauges on a real server, read as llm-d's ``lora-load-state-scorer`` reads them.

For each adapter, the scorer's tier is computed from ``/metrics`` alone
(``vllm:lora_adapter_loaded``, ``vllm:num_gpu_loaded_lora_adapters``,
``vllm:max_gpu_lora_adapters`` and the active adapters of ``vllm:lora_requests_info``) and checked
against what the server holds (``GET /v1/adapters``): in the pool 1.0, only in host memory 0.7,
not loaded with a free seat 0.6, every seat held by a pinned or busy adapter 0.0.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from lora_guard.demo.adapters import make_adapters
from lora_guard.demo.scrape import (
    CPU,
    EVICTABLE,
    FREE_SLOT,
    GPU,
    SATURATED,
    metric_samples,
    scorer_tier,
)
from lora_guard.demo.testing import ServerProcess, start_server

SEATS = 2


@pytest.fixture(scope="module")
def seated(
    tiny: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    """Two seats for four adapters of ranks 4 and 8."""
    model, _ = tiny
    root = tmp_path_factory.mktemp("residency")
    make_adapters(model, root / "adapters", n=4, ranks=(4, 8), strength=0.5, prefix="r")
    log = root / "server.log"
    server = start_server(model, root / "adapters", "--max-loras", str(SEATS), log=log)
    yield server
    assert server.stop() == 0, log.read_text()


def held_tier(url: str, adapter: str, busy: set[str]) -> float:
    """The same tier from what the server says it holds."""
    rows = {row["id"]: row for row in httpx.get(f"{url}/v1/adapters").json()}
    row = rows[adapter]
    if row["tier"] != "disk":
        return GPU if row["tier"] == "device" else CPU
    in_pool = [r for r in rows.values() if r["tier"] == "device"]
    if len(in_pool) < SEATS:
        return FREE_SLOT
    movable = [r for r in in_pool if not r["pinned"] and r["id"] not in busy]
    return EVICTABLE if movable else SATURATED


def generate(url: str, adapter: str) -> None:
    body = {"inputs": "abc", "parameters": {"max_new_tokens": 2, "adapter_id": adapter}}
    httpx.post(f"{url}/generate", json=body, timeout=60).raise_for_status()


def test_the_scorer_reads_from_metrics_what_the_server_holds(seated: ServerProcess) -> None:
    url = seated.url
    adapters = sorted(r["id"] for r in httpx.get(f"{url}/v1/adapters").json())
    spare, pinned, cold = adapters[0], adapters[1:3], adapters[3]

    # at start, before any request: nothing loaded, every seat free
    for adapter in adapters:
        assert scorer_tier(url, adapter) == held_tier(url, adapter, set()) == FREE_SLOT

    # one adapter in the pool: it scores as resident, the others still see a free seat
    generate(url, spare)
    assert scorer_tier(url, spare) == held_tier(url, spare, set()) == GPU
    assert scorer_tier(url, cold) == held_tier(url, cold, set()) == FREE_SLOT

    # a pinned adapter and a busy one take the seats: the first leaves for host memory, and the
    # last finds every seat held by an adapter that may not leave now
    generate(url, pinned[0])
    httpx.post(f"{url}/v1/adapters/{pinned[0]}/pin").raise_for_status()
    body = {"inputs": "abc", "parameters": {"max_new_tokens": 400, "adapter_id": pinned[1]}}
    with httpx.stream("POST", f"{url}/generate_stream", json=body, timeout=60) as stream:
        lines = stream.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))  # it runs now
        tiers = {a: scorer_tier(url, a) for a in adapters}
        held = {a: held_tier(url, a, busy={pinned[1]}) for a in adapters}
        assert metric_samples(url)["vllm:num_requests_running"][0][1] == 1  # still running
        for _ in lines:
            pass
    assert tiers == held
    assert tiers == {spare: CPU, pinned[0]: GPU, pinned[1]: GPU, cold: SATURATED}

    # the labels a router keys by: the base model, and each loaded adapter's rank
    samples = metric_samples(url)
    info = httpx.get(f"{url}/info").json()
    (count_labels, count), *_ = samples["vllm:num_gpu_loaded_lora_adapters"]
    assert count_labels["model_name"] == info["model_id"] and count == SEATS
    ranks = {r["id"]: r["rank"] for r in httpx.get(f"{url}/v1/adapters").json()}
    for labels, _ in samples["vllm:lora_adapter_loaded"]:
        assert int(labels["rank"]) == ranks[labels["adapter_name"]]
    loads = {
        labels["transition"]: v for labels, v in samples["vllm:lora_adapter_load_seconds_count"]
    }
    assert loads["load"] >= SEATS + 1 and loads["activate"] >= SEATS + 1
