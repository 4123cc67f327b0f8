"""A small KV pool: requests that together outgrow it are preempted and resumed, and all complete
with the tokens they get alone; a request that could never fit is refused up front with 422."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from lora_guard.demo.scrape import metric
from lora_guard.demo.testing import ServerProcess, engine_greedy, start_server

POOL_TOKENS = 256  # 64 blocks of 4 tokens; a block of the tiny model is 2 KiB
REQUESTS = [
    ("The capital of France is", None),
    ("The capital of Italy is", "a-00"),
    ("A LoRA adapter changes", "a-01"),
    ("Numbers: 0 1 2 3", "a-02"),
    ("The quick brown fox", "a-00"),
]
NEW_TOKENS = 80  # five of these, run together, need about 1.7 pools


@pytest.fixture(scope="module")
def small_pool(
    tiny: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    model, adapters = tiny
    log = tmp_path_factory.mktemp("small-pool") / "server.log"
    server = start_server(
        model,
        adapters,
        "--kv-cache-memory",
        "128KiB",
        "--max-total-tokens",
        "1000",
        "--cold-loads-per-minute",
        "1000",
        "--policies",
        "cold-budget,kv-namespace",
        log=log,
    )
    yield server
    assert server.stop() == 0


def test_the_pool_bounds_the_total_tokens_announced(small_pool: ServerProcess) -> None:
    info = httpx.get(small_pool.url + "/info").json()
    assert info["max_total_tokens"] == POOL_TOKENS  # not the 1000 asked for
    assert info["max_input_tokens"] == POOL_TOKENS - 1


@pytest.mark.parametrize(
    ("words", "max_new_tokens", "message"),
    [
        (300, 1, "`inputs` tokens must be <= 255"),  # larger than the whole pool
        (100, 100, "`inputs` tokens + `max_new_tokens` must be <= 256"),  # 200 + 100
        (20, 1000, "`inputs` tokens + `max_new_tokens` must be <= 256"),
    ],
)
def test_a_request_that_can_never_fit_is_refused_up_front(
    small_pool: ServerProcess, words: int, max_new_tokens: int, message: str
) -> None:
    body = {"inputs": " 7" * words, "parameters": {"max_new_tokens": max_new_tokens}}
    started = time.monotonic()
    for route in ("/generate", "/generate_stream"):
        r = httpx.post(small_pool.url + route, json=body, timeout=60)
        assert r.status_code == 422, r.text
        assert r.json()["error_type"] == "validation" and message in r.json()["error"]
    assert time.monotonic() - started < 5  # refused, not queued
    assert metric(small_pool.url, "vllm:num_requests_waiting") == 0


def test_requests_outgrowing_the_pool_are_preempted_and_resume_with_the_same_tokens(
    small_pool: ServerProcess, tiny: tuple[Path, Path]
) -> None:
    model, adapters = tiny
    alone = engine_greedy(
        model, {p.name: p for p in adapters.iterdir() if p.is_dir()}, REQUESTS, NEW_TOKENS
    )
    assert sum(len(t) for t in alone) > POOL_TOKENS  # they cannot all fit at once
    preempted = metric(small_pool.url, "vllm:num_preemptions_total")
    answers: dict[int, httpx.Response] = {}

    def send(i: int) -> None:
        prompt, adapter = REQUESTS[i]
        body = {
            "inputs": prompt,
            "parameters": {"max_new_tokens": NEW_TOKENS, "adapter_id": adapter},
        }
        answers[i] = httpx.post(small_pool.url + "/generate", json=body, timeout=120)

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(REQUESTS))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert len(answers) == len(REQUESTS), "a request hung"
    for i, r in answers.items():
        assert r.status_code == 200, r.text
        assert [t["id"] for t in r.json()["details"]["tokens"]] == alone[i], REQUESTS[i]
    preemptions = metric(small_pool.url, "vllm:num_preemptions_total") - preempted
    print(
        f"\nkv pressure: {len(REQUESTS)} requests, {sum(map(len, alone))} tokens through a "
        f"{POOL_TOKENS}-token pool, {preemptions:.0f} preemptions, tokens as alone"
    )
    assert preemptions > 0
    assert metric(small_pool.url, "vllm:kv_cache_usage_perc") == 0
