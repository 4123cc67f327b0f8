"""API keys (401/403, tenants, allowed adapters) and adapter administration at run time."""

from __future__ import annotations

import hashlib
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from lora_guard.demo.adapters import make_adapters
from lora_guard.demo.testing import ServerProcess, start_server

KEYS = """
[keys.acme]
key = "acme-secret-key"
tenant = "acme"
adapters = ["a-00", "a-01", "late-*"]

[keys.ops]
sha256 = "{ops_sha}"
tenant = "ops"
admin = true
"""


@pytest.fixture(scope="module")
def guarded(
    tiny: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[ServerProcess, Path]]:
    model, adapters = tiny
    root = tmp_path_factory.mktemp("guarded")
    adapter_dir = root / "adapters"
    shutil.copytree(adapters, adapter_dir)
    key_file = root / "keys.toml"
    key_file.write_text(KEYS.format(ops_sha=hashlib.sha256(b"ops-secret-key").hexdigest()))
    server = start_server(
        model,
        adapter_dir,
        "--api-key-file",
        str(key_file),
        "--cold-loads-per-minute",
        "100",
        log=root / "log",
    )
    yield server, adapter_dir
    assert server.stop() == 0


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def generate(url: str, adapter: str | None, key: str | None) -> httpx.Response:
    body = {"inputs": "hello", "parameters": {"max_new_tokens": 2, "adapter_id": adapter}}
    return httpx.post(url + "/generate", json=body, headers=auth(key) if key else {}, timeout=60)


def test_keys_gate_generation(guarded: tuple[ServerProcess, Path]) -> None:
    server, _ = guarded
    assert generate(server.url, None, None).status_code == 401
    assert generate(server.url, None, "wrong-key-here").status_code == 401
    assert generate(server.url, "a-00", "acme-secret-key").status_code == 200
    forbidden = generate(server.url, "a-02", "acme-secret-key")  # not in acme's patterns
    assert forbidden.status_code == 403 and forbidden.json()["error_type"] == "forbidden"
    assert httpx.get(server.url + "/health").status_code == 200  # open for probes


def test_admin_keys_use_every_adapter_and_tenants_their_own(
    guarded: tuple[ServerProcess, Path],
) -> None:
    server, _ = guarded
    r = generate(server.url, "a-00", "ops-secret-key")
    assert r.status_code == 200  # ops may use everything
    r = httpx.post(
        server.url + "/v1/chat/completions",
        headers=auth("acme-secret-key"),
        json={"model": "a-01", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    )
    assert r.status_code == 200


def test_admin_routes_need_an_admin_key(guarded: tuple[ServerProcess, Path]) -> None:
    server, _ = guarded
    assert httpx.get(server.url + "/v1/adapters").status_code == 401
    r = httpx.get(server.url + "/v1/adapters", headers=auth("acme-secret-key"))
    assert r.status_code == 403 and r.json()["error_type"] == "forbidden"
    r = httpx.get(server.url + "/v1/adapters", headers=auth("ops-secret-key"))
    assert r.status_code == 200
    rows = {row["id"]: row for row in r.json()}
    assert set(rows) >= {"a-00", "a-01", "a-02"}
    assert rows["a-00"]["tier"] in ("device", "host") and rows["a-00"]["rank"] in (4, 8)


def test_metrics_need_an_admin_key_when_there_is_a_key_file(
    guarded: tuple[ServerProcess, Path],
) -> None:
    server, _ = guarded
    assert httpx.get(server.url + "/metrics").status_code == 401
    r = httpx.get(server.url + "/metrics", headers=auth("acme-secret-key"))
    assert r.status_code == 403 and r.json()["error_type"] == "forbidden"
    r = httpx.get(server.url + "/metrics", headers=auth("ops-secret-key"))
    assert r.status_code == 200 and "lora_guard_adapter_lookups_total" in r.text
    assert httpx.get(server.url + "/info").status_code == 200  # open for probes, as /health


def test_a_server_without_a_key_file_says_at_start_that_every_route_is_open(
    server: ServerProcess,
) -> None:
    assert "no --api-key-file: every route is open" in server.log.read_text()
    assert httpx.get(server.url + "/metrics").status_code == 200


def test_load_unload_pin_at_run_time(
    guarded: tuple[ServerProcess, Path], tiny: tuple[Path, Path]
) -> None:
    server, adapter_dir = guarded
    model, _ = tiny
    ops = auth("ops-secret-key")
    make_adapters(model, adapter_dir / "new", n=1, ranks=(4,), strength=0.5, prefix="late")
    shutil.move(adapter_dir / "new" / "late-00", adapter_dir / "late-00")

    assert generate(server.url, "late-00", "ops-secret-key").status_code == 422  # not known yet
    body = {"lora_name": "late-00", "lora_path": str(adapter_dir / "late-00")}
    r = httpx.post(server.url + "/v1/load_lora_adapter", headers=ops, json=body)
    assert r.status_code == 200, r.text
    assert generate(server.url, "late-00", "ops-secret-key").status_code == 200

    r = httpx.post(server.url + "/v1/adapters/late-00/pin", headers=ops)
    assert r.status_code == 200 and "late-00" in r.json()["pinned"]
    pinned = {
        row["id"]: row["pinned"]
        for row in httpx.get(server.url + "/v1/adapters", headers=ops).json()
    }
    assert pinned["late-00"] is True
    assert httpx.post(server.url + "/v1/adapters/late-00/unpin", headers=ops).status_code == 200

    r = httpx.post(
        server.url + "/v1/unload_lora_adapter", headers=ops, json={"lora_name": "late-00"}
    )
    assert r.status_code == 200
    assert generate(server.url, "late-00", "ops-secret-key").status_code == 422
    # Gone now: the engine, which alone knows the adapters, says so to every admin route.
    gone = {"error": "adapter 'late-00' is not known", "error_type": "not_found"}
    for path, body in (
        ("/v1/adapters/late-00/pin", None),
        ("/v1/adapters/late-00/unpin", None),
        ("/v1/unload_lora_adapter", {"lora_name": "late-00"}),
    ):
        r = httpx.post(server.url + path, headers=ops, json=body)
        assert (r.status_code, r.json()) == (404, gone), path


@pytest.mark.parametrize(
    "body",
    [
        {"lora_name": "x", "lora_path": "/etc"},
        {"lora_name": "x", "lora_path": "../../.."},
        {"lora_name": "../x"},
        {"lora_name": "a/b"},
    ],
)
def test_load_refuses_paths_outside_the_adapter_dirs(
    guarded: tuple[ServerProcess, Path], body: dict[str, str]
) -> None:
    server, _ = guarded
    r = httpx.post(server.url + "/v1/load_lora_adapter", headers=auth("ops-secret-key"), json=body)
    assert r.status_code in (403, 422), r.text
    assert r.json()["error_type"] in ("forbidden", "validation")


def test_symlink_leading_outside_is_refused(
    guarded: tuple[ServerProcess, Path], tmp_path: Path
) -> None:
    server, adapter_dir = guarded
    outside = tmp_path / "outside"
    shutil.copytree(next(p for p in adapter_dir.iterdir() if p.name == "a-00"), outside)
    (adapter_dir / "sneaky").symlink_to(outside)
    r = httpx.post(
        server.url + "/v1/load_lora_adapter",
        headers=auth("ops-secret-key"),
        json={"lora_name": "sneaky"},
    )
    assert r.status_code == 403, r.text
