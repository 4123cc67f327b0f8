"""Hostile adapter names never reach a file outside the adapter directory, and tenants stay apart:
with ``--kv-namespace-scope tenant`` one tenant's prompt is never a prefix-cache hit for another,
and with an API-key file a tenant uses only its own adapters and cannot pose as another."""

from __future__ import annotations

import hashlib
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from lora_guard.demo.scrape import metric
from lora_guard.demo.testing import ServerProcess, start_server

KEYS = """
[keys.alpha]
key = "alpha-secret-key"
tenant = "alpha"
adapters = ["a-00"]

[keys.beta]
key = "beta-secret-key"
tenant = "beta"
adapters = ["a-00", "a-01"]

[keys.ops]
sha256 = "{ops_sha}"
tenant = "ops"
admin = true
"""
ALPHA = {"Authorization": "Bearer alpha-secret-key"}
BETA = {"Authorization": "Bearer beta-secret-key"}
OPS = {"Authorization": "Bearer ops-secret-key"}
# one row a line, as a table reads (fmt: skip)
HOSTILE_IDS = [
    "..", ".", "../a-00", "a-00/../a-01", "../outside/a-02", "/etc/passwd", "~", "~root/a",
    "a-00/", "a\\..\\b", "C:\\a", "%2e%2e%2fa-00", "a-00\x00", "a-00\n", " a-00", "a b", "a:b",
    "a*", "a?", "é", "a\u200b-00", "a" * 200, "evil", "late-link",
]  # fmt: skip


@pytest.fixture(scope="module")
def tenants(
    tiny: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[ServerProcess, Path]]:
    """Tenant-scoped prefix cache, API keys, and an adapter directory holding a link that leads
    to a valid adapter outside it."""
    model, tiny_adapters = tiny
    root = tmp_path_factory.mktemp("tenants")
    adapters, outside = root / "adapters", root / "outside"
    shutil.copytree(tiny_adapters, adapters)
    shutil.copytree(tiny_adapters / "a-02", outside / "a-02")
    (adapters / "evil").symlink_to(outside / "a-02")
    keys = root / "keys.toml"
    keys.write_text(KEYS.format(ops_sha=hashlib.sha256(b"ops-secret-key").hexdigest()))
    server = start_server(
        model,
        adapters,
        "--kv-namespace-scope",
        "tenant",
        "--api-key-file",
        str(keys),
        "--cold-loads-per-minute",
        "1000",
        log=root / "server.log",
    )
    yield server, adapters
    assert server.stop() == 0


def generate(url: str, prompt: str, adapter: str | None, headers: dict[str, str]) -> httpx.Response:
    body = {"inputs": prompt, "parameters": {"max_new_tokens": 4, "adapter_id": adapter}}
    return httpx.post(url + "/generate", json=body, headers=headers, timeout=60)


def disk_reads(url: str) -> float:
    loads = ("loaded", "failed")
    return sum(metric(url, "lora_guard_cold_loads_total", OPS, outcome=o) for o in loads)


def test_hostile_adapter_ids_get_a_clear_4xx_and_read_nothing(
    tenants: tuple[ServerProcess, Path],
) -> None:
    server, adapters = tenants
    (adapters / "late-link").symlink_to(adapters.parent / "outside" / "a-02")  # added live
    reads = disk_reads(server.url)
    for adapter_id in HOSTILE_IDS:
        answers = [
            generate(server.url, "hello", adapter_id, OPS),
            httpx.post(
                server.url + "/v1/completions",
                headers=OPS,
                timeout=60,
                json={"model": adapter_id, "prompt": "hello", "max_tokens": 2},
            ),
            httpx.post(
                server.url + "/v1/chat/completions",
                headers=OPS,
                timeout=60,
                json={
                    "model": adapter_id,
                    "max_tokens": 2,
                    "messages": [{"role": "user", "content": "hi"}],
                },
            ),
            httpx.post(
                server.url + "/v1/load_lora_adapter",
                headers=OPS,
                timeout=60,
                json={"lora_name": adapter_id},
            ),
        ]
        for r in answers:
            assert r.status_code in (403, 404, 422), (adapter_id, r.status_code, r.text)
            message = r.json()["error"]
            assert any(
                reason in message
                for reason in (
                    "invalid adapter id",
                    "is not known",
                    "inside the configured",
                    "no adapter folder",
                )
            ), (adapter_id, message)
    assert disk_reads(server.url) == reads  # no adapter file was read, inside or outside
    listed = {row["id"] for row in httpx.get(server.url + "/v1/adapters", headers=OPS).json()}
    assert listed == {"a-00", "a-01", "a-02"}  # the link found at start-up is not served
    assert "evil links outside" in (adapters.parent / "server.log").read_text()


def test_tenant_scope_keeps_prefix_cache_hits_within_one_tenant(
    tenants: tuple[ServerProcess, Path],
) -> None:
    server, _ = tenants
    prompt = "Tenants send requests to one endpoint; each request names an adapter and a prompt."

    def hit_tokens(headers: dict[str, str]) -> tuple[float, list[int]]:
        before = metric(server.url, "lora_guard_prefix_cache_hit_tokens_total", OPS)
        r = generate(server.url, prompt, "a-00", headers)
        assert r.status_code == 200, r.text
        tokens = [t["id"] for t in r.json()["details"]["tokens"]]
        return metric(server.url, "lora_guard_prefix_cache_hit_tokens_total", OPS) - before, tokens

    first, tokens = hit_tokens(ALPHA)
    assert first == 0
    again, same = hit_tokens(ALPHA)
    assert again >= 16 and same == tokens  # alpha reuses its own prompt's KV
    spoofed, other = hit_tokens({**BETA, "X-Tenant-Id": "alpha"})
    assert spoofed == 0 and other == tokens  # beta, posing as alpha, gets no hit on alpha's KV
    own, _ = hit_tokens(BETA)
    assert own >= 16  # beta hits its own


def test_adapter_scope_shares_the_prefix_cache_across_tenants(server: ServerProcess) -> None:
    """The control: under the default scope the same prompt is a hit for another tenant, so the
    test above would see it if tenant scope leaked."""
    prompt = "A LoRA adapter changes the attention and projection weights of a base model."
    assert generate(server.url, prompt, "a-00", {"X-Tenant-Id": "one"}).status_code == 200
    before = metric(server.url, "lora_guard_prefix_cache_hit_tokens_total")
    assert generate(server.url, prompt, "a-00", {"X-Tenant-Id": "two"}).status_code == 200
    assert metric(server.url, "lora_guard_prefix_cache_hit_tokens_total") - before >= 16


def test_a_tenant_uses_only_the_adapters_of_its_key(tenants: tuple[ServerProcess, Path]) -> None:
    server, _ = tenants
    assert generate(server.url, "hello", "a-00", ALPHA).status_code == 200
    for adapter in ("a-01", "a-02"):
        r = generate(server.url, "hello", adapter, ALPHA)
        assert r.status_code == 403 and r.json()["error_type"] == "forbidden", r.text
    r = httpx.post(
        server.url + "/v1/completions",
        headers=ALPHA,
        timeout=60,
        json={"model": "a-01", "prompt": "hello", "max_tokens": 2},
    )
    assert r.status_code == 403, r.text
    assert generate(server.url, "hello", "a-01", BETA).status_code == 200
    for route in ("/v1/adapters", "/v1/adapters/a-00/pin"):
        method = "GET" if route == "/v1/adapters" else "POST"
        r = httpx.request(method, server.url + route, headers=BETA, timeout=60)
        assert r.status_code == 403, r.text  # admin routes need the admin key
