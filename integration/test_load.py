"""Load, then soak: eight clients on loopback over twelve adapters (four device slots) for a fixed
time, every request accounted for (200 with the in-process engine's tokens, or 429 with
Retry-After; never a hang, never a 5xx), and once idle no running request, no held KV block, and
residency that matches between ``GET /v1/adapters`` and the metrics.

``pytest -m study integration/test_load.py -s`` prints the figures quoted in docs/reliability.md.
"""

from __future__ import annotations

import json
import random
import statistics
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from lora_guard.demo.adapters import make_adapters
from lora_guard.demo.scrape import metric, metric_samples
from lora_guard.demo.testing import ServerProcess, engine_greedy, eventually, start_server

CLIENTS = 8
DURATION_S = 20.0
NUM_ADAPTERS = 12
SLOTS = 4
MAX_CONCURRENT = 6  # below CLIENTS: some answers must be 429
NEW_TOKENS = 12
PROMPTS = ("The capital of Spain is", "Tenants send requests to", "User: hello. Assistant:")
REQUEST_TIMEOUT_S = 30.0  # an answer later than this counts as a hang


@dataclass
class Tally:
    """What the clients saw; ``problems`` holds anything that is neither a correct 200 nor a
    429 with Retry-After."""

    statuses: Counter[str] = field(default_factory=Counter)
    latencies: list[float] = field(default_factory=list)
    engine_rejections: int = 0  # 429s decided inside the engine (the cold-load budget)
    problems: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


@pytest.fixture(scope="module")
def fleet(
    tiny: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[ServerProcess, dict[tuple[str, str | None], list[int]]]]:
    model, _ = tiny
    root = tmp_path_factory.mktemp("load")
    folders = make_adapters(
        model, root / "adapters", n=NUM_ADAPTERS, ranks=(4, 8), strength=0.5, prefix="L"
    )
    keys = [(p, a) for p in PROMPTS for a in (None, *(f.name for f in folders))]
    tokens = engine_greedy(model, {f.name: f for f in folders}, keys, NEW_TOKENS)
    server = start_server(
        model,
        root / "adapters",
        "--max-loras",
        str(SLOTS),
        "--max-cpu-loras",
        "6",
        "--cold-loads-per-minute",
        "30",
        "--max-concurrent-requests",
        str(MAX_CONCURRENT),
        log=root / "server.log",
    )
    yield server, dict(zip(keys, tokens, strict=True))
    assert server.stop() == 0


def stream_tokens(r: httpx.Response) -> tuple[list[int], str | None]:
    """The token ids of an SSE answer, and the error event's body if one came."""
    ids: list[int] = []
    for line in r.iter_lines():
        if line.startswith("data:"):
            event = json.loads(line[5:])
            if "error" in event:
                return ids, json.dumps(event)
            ids.append(event["token"]["id"])
    return ids, None


def client(
    url: str,
    seed: int,
    expected: dict[tuple[str, str | None], list[int]],
    tally: Tally,
    stop_at: float,
) -> None:
    rng = random.Random(seed)
    adapters = [None, *sorted({a for _, a in expected if a is not None})]
    weights = [1 / (rank + 1) for rank in range(len(adapters))]  # Zipf-like popularity
    with httpx.Client(base_url=url, timeout=REQUEST_TIMEOUT_S) as http:
        while time.monotonic() < stop_at:
            prompt, adapter = rng.choice(PROMPTS), rng.choices(adapters, weights)[0]
            route = rng.choice(("/generate", "/generate_stream"))
            parameters = {"max_new_tokens": NEW_TOKENS, "adapter_id": adapter}
            body = {"inputs": prompt, "parameters": parameters}
            what = f"{route} {adapter}"
            started = time.monotonic()
            try:
                with http.stream("POST", route, json=body) as r:
                    if r.status_code == 200 and route == "/generate_stream":
                        ids, error = stream_tokens(r)
                    elif r.status_code == 200:
                        r.read()
                        ids, error = [t["id"] for t in r.json()["details"]["tokens"]], None
                    else:
                        ids, error = [], r.read().decode()
            except httpx.HTTPError as exc:
                with tally.lock:
                    tally.statuses["no answer"] += 1
                    tally.problems.append(f"{what}: no answer ({exc!r})")
                continue
            elapsed = time.monotonic() - started
            with tally.lock:
                tally.statuses[str(r.status_code)] += 1
                if r.status_code == 200 and error is None:
                    tally.latencies.append(elapsed)
                    if ids != expected[prompt, adapter]:
                        tally.problems.append(f"{what}: wrong tokens {ids}")
                elif r.status_code == 429 and r.headers.get("retry-after"):
                    tally.engine_rejections += "Model is overloaded" not in (error or "")
                else:
                    tally.problems.append(f"{what}: {r.status_code} {error}")
            if r.status_code == 429:  # back off as told, but at most a second
                time.sleep(min(float(r.headers.get("retry-after", 1)), 1.0))


def settle(url: str, timeout: float = 15) -> dict[str, list[tuple[dict[str, str], float]]]:
    """The metrics once the server is idle (no request running or waiting, no block held)."""

    def idle() -> dict[str, list[tuple[dict[str, str], float]]]:
        found = metric_samples(url)
        values = [
            found[name][0][1]
            for name in (
                "vllm:num_requests_running",
                "vllm:num_requests_waiting",
                "vllm:kv_cache_usage_perc",
            )
        ]
        assert values == [0, 0, 0], values
        return found

    return eventually(idle, timeout_s=timeout, what="the server to be idle")


@pytest.mark.study
def test_load_then_soak_every_request_accounted_for(
    fleet: tuple[ServerProcess, dict[tuple[str, str | None], list[int]]],
) -> None:
    server, expected = fleet
    successes = metric(server.url, "tgi_request_success")
    finished = metric(server.url, "tgi_request_count")
    tally = Tally()
    stop_at = time.monotonic() + DURATION_S
    threads = [
        threading.Thread(target=client, args=(server.url, seed, expected, tally, stop_at))
        for seed in range(CLIENTS)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(DURATION_S + REQUEST_TIMEOUT_S + 10)
    assert not any(t.is_alive() for t in threads), "a client hung"

    total = sum(tally.statuses.values())
    latencies = sorted(tally.latencies)
    p50 = statistics.median(latencies)
    p95 = latencies[int(0.95 * (len(latencies) - 1))]
    print(
        f"\nload: {CLIENTS} clients, {NUM_ADAPTERS} adapters on {SLOTS} slots, "
        f"{DURATION_S:.0f} s: {total} requests {dict(tally.statuses)}, "
        f"{tally.engine_rejections} of the 429s from the cold-load budget; "
        f"latency of the 200s p50 {p50 * 1000:.0f} ms, p95 {p95 * 1000:.0f} ms; "
        f"problems {len(tally.problems)}"
    )
    assert not tally.problems, "\n".join(tally.problems[:20])
    assert tally.statuses["200"] >= 100 and tally.statuses["429"] >= 1, tally.statuses

    # Soak: idle, nothing held, nothing lost.
    found = settle(server.url)
    assert found["vllm:num_requests_running"][0][1] == 0
    assert found["vllm:num_requests_waiting"][0][1] == 0
    assert found["vllm:kv_cache_usage_perc"][0][1] == 0
    assert metric(server.url, "tgi_request_success") - successes == tally.statuses["200"]
    engine_answers = tally.statuses["200"] + tally.engine_rejections
    assert metric(server.url, "tgi_request_count") - finished == engine_answers
    rows = httpx.get(server.url + "/v1/adapters", timeout=10).json()
    listed = {(r["id"], r["tier"]) for r in rows if r["tier"] in ("device", "host")}
    resident = {
        (labels["adapter_id"], labels["tier"])
        for labels, value in found["lora_guard_adapter_resident"]
        if value == 1
    }
    assert listed == resident
    assert sum(tier == "device" for _, tier in listed) <= SLOTS
    assert httpx.get(server.url + "/health").status_code == 200
