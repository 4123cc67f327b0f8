"""What a Gateway API Inference Extension endpoint picker reads from a real server: the LoRA
labels of ``vllm:lora_requests_info`` on ``/metrics``, and the tenant from its fairness header."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from lora_guard.demo.scrape import metric, metric_samples
from lora_guard.demo.testing import ServerProcess, eventually, start_server


@pytest.fixture(scope="module")
def gateway_server(
    tiny: tuple[Path, Path],
    tmp_path_factory: pytest.TempPathFactory,
    fault_env: Callable[[Path], dict[str, str]],
) -> Iterator[tuple[ServerProcess, Path]]:
    """Two seats for the three tiny adapters, prefix-cache hits kept within a tenant, and the
    test plugin that holds requests of tenant ``hold`` waiting while a file exists (faults.py)."""
    model, adapters = tiny
    root = tmp_path_factory.mktemp("gateway")
    hold = root / "hold"
    server = start_server(
        model,
        adapters,
        "--max-loras",
        "2",
        "--kv-namespace-scope",
        "tenant",
        "--cold-loads-per-minute",
        "1000",
        "--plugin",
        "faults:injector",
        log=root / "server.log",
        env=fault_env(hold),
    )
    yield server, hold
    assert server.stop() == 0, (root / "server.log").read_text()


def lora_info(url: str) -> dict[str, str]:
    rows = metric_samples(url)["vllm:lora_requests_info"]
    assert len(rows) == 1, rows  # only the latest label set is exposed
    return rows[0][0]


def picker_view(info: dict[str, str]) -> tuple[set[str], set[str], bool]:
    """Active and waiting adapters, and whether there is room to load one, as the endpoint
    picker's LoRA affinity reads them: room when ``len(active) + len(waiting) < max_lora``."""
    active = {a for a in info["running_lora_adapters"].split(",") if a}
    waiting = {a for a in info["waiting_lora_adapters"].split(",") if a}
    return active, waiting, len(active) + len(waiting) < int(info["max_lora"])


def generate(
    url: str,
    adapter: str | None,
    headers: dict[str, str] | None = None,
    prompt: str = "hello",
    tokens: int = 2,
) -> httpx.Response:
    body = {"inputs": prompt, "parameters": {"max_new_tokens": tokens, "adapter_id": adapter}}
    return httpx.post(url + "/generate", json=body, headers=headers or {}, timeout=60)


def test_idle_resident_adapters_keep_affinity_without_making_the_replica_look_full(
    gateway_server: tuple[ServerProcess, Path],
) -> None:
    url = gateway_server[0].url
    assert generate(url, "a-00").status_code == 200
    assert generate(url, "a-01").status_code == 200
    active, waiting, room = picker_view(lora_info(url))
    # Both seats hold an adapter no request needs: the picker sees both as active (a request for
    # either is served without a load) and still sees room to load a third.
    assert active == {"a-00", "a-01"} and waiting == set() and room
    assert generate(url, "a-02").status_code == 200
    active, _, room = picker_view(lora_info(url))
    assert "a-02" in active and len(active) == 2 and room


def test_a_replica_whose_adapters_queued_requests_need_looks_full(
    gateway_server: tuple[ServerProcess, Path],
) -> None:
    server, hold = gateway_server
    url = server.url
    for adapter in ("a-00", "a-01"):
        assert generate(url, adapter).status_code == 200  # both resident, idle
    assert picker_view(lora_info(url))[2]
    hold.touch()
    with ThreadPoolExecutor(2) as clients:
        held = [clients.submit(generate, url, a, {"X-Tenant-Id": "hold"}) for a in ("a-00", "a-01")]
        count = Path(f"{hold}.count")
        eventually(
            lambda: count.exists() and count.read_text() == "2",
            timeout_s=30,
            what="2 requests held",
        )
        assert generate(url, None).status_code == 200  # a step runs: the labels are fresh
        info = lora_info(url)
        active, waiting, room = picker_view(info)
        # Two queued requests need both resident adapters: no load can take a seat now.
        assert active == {"a-00", "a-01"} and waiting == set() and not room, info
        assert info["max_lora"] == "2"
        hold.unlink()
        assert [f.result().status_code for f in held] == [200, 200]
    assert generate(url, None).status_code == 200
    assert picker_view(lora_info(url))[2]  # served: the adapters are idle again


def test_the_tenant_comes_from_the_gateway_fairness_header(
    gateway_server: tuple[ServerProcess, Path],
) -> None:
    url = gateway_server[0].url
    prompt = "The capital of France is Paris. The capital of Italy is Rome. And of Spain?"

    def hit_tokens(headers: dict[str, str]) -> float:
        before = metric(url, "lora_guard_prefix_cache_hit_tokens_total")
        assert generate(url, "a-00", headers, prompt).status_code == 200
        return metric(url, "lora_guard_prefix_cache_hit_tokens_total") - before

    gold = {"X-Gateway-Inference-Fairness-Id": "gold"}
    assert hit_tokens(gold) == 0
    assert hit_tokens(gold) >= 16  # the same tenant reuses its prompt's KV
    assert hit_tokens({"X-Gateway-Inference-Fairness-Id": "silver"}) == 0  # another tenant
    assert hit_tokens({}) == 0  # no header: the default tenant, another again
    # X-Tenant-Id, lora-guard's own header, comes before the gateway's.
    assert hit_tokens({"X-Tenant-Id": "gold", "X-Gateway-Inference-Fairness-Id": "bronze"}) >= 16
