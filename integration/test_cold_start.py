"""A fresh server asked for 16 adapters at once, all of which fit in its cache pool, answers every
request (no 429: loads into free memory cost no budget), with the in-process engine's tokens; with
the default settings (no seat cap) all 16 are resident at once."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from lora_guard.demo.adapters import make_adapters
from lora_guard.demo.scrape import metric
from lora_guard.demo.testing import engine_greedy, start_server

PROMPT = "The capital of France is"
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def sixteen(tiny: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    model, _ = tiny
    out = tmp_path_factory.mktemp("sixteen-adapters")
    make_adapters(model, out, n=16, ranks=(4, 8), strength=0.5, prefix="s")
    return out


def _ask(url: str, adapter: str) -> httpx.Response:
    body = {"inputs": PROMPT, "parameters": {"max_new_tokens": NEW_TOKENS, "adapter_id": adapter}}
    return httpx.post(url + "/generate", json=body, timeout=120)


def test_sixteen_cold_adapters_at_once_all_answer(
    tiny: tuple[Path, Path], sixteen: Path, tmp_path: Path
) -> None:
    model, _ = tiny
    names = sorted(p.name for p in sixteen.iterdir() if p.is_dir())
    server = start_server(model, sixteen, "--cache-memory", "64MiB", log=tmp_path / "server.log")
    try:
        with ThreadPoolExecutor(len(names)) as pool:
            answers = list(pool.map(lambda a: _ask(server.url, a), names))
        assert [r.status_code for r in answers] == [200] * len(names), [
            r.text for r in answers if r.status_code != 200
        ]
        expected = engine_greedy(
            model, {n: sixteen / n for n in names}, [(PROMPT, n) for n in names], NEW_TOKENS
        )
        got = [[t["id"] for t in r.json()["details"]["tokens"]] for r in answers]
        assert got == expected
        assert metric(server.url, "lora_guard_cold_loads_total", outcome="rejected") == 0
        assert metric(server.url, "lora_guard_adapter_wait_ms_count") >= len(names)
        assert metric(server.url, "lora_guard_cache_pool_bytes", kind="adapter") > 0
        assert metric(server.url, "lora_guard_adapter_resident", tier="device") == len(names)
    finally:
        assert server.stop() == 0, (tmp_path / "server.log").read_text()
