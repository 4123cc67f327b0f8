"""More adapters in use than seats, through the server with the default policies: a short request
for a seventh adapter, sent while two of six long requests on six others run in the two seats,
ends before any long one, since a request shorter than a seated adapter's remaining work
takes its turn at a seat once the residency quantum (10 ms here) is over instead of waiting for
whole long requests; how long the policies held each request back is on /metrics."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx

from lora_guard.demo.adapters import make_adapters
from lora_guard.demo.scrape import metric_samples
from lora_guard.demo.testing import start_server

LONG_TOKENS = 480
QUANTUM_MS = 10


def test_a_short_request_for_a_seventh_adapter_ends_before_the_long_ones(
    tiny: tuple[Path, Path], tmp_path: Path
) -> None:
    model, _ = tiny
    adapter_dir = tmp_path / "adapters"
    names = [p.name for p in make_adapters(model, adapter_dir, n=7, ranks=(4,), prefix="t")]
    server = start_server(
        model,
        adapter_dir,
        "--max-loras",
        "2",
        "--residency-quantum-ms",
        str(QUANTUM_MS),
        log=tmp_path / "server.log",
    )
    ended: dict[str, float] = {}
    first_token = {f"long-{i}": threading.Event() for i in range(6)}
    errors: list[BaseException] = []

    def send(name: str, adapter: str, tokens: int) -> None:
        body = {
            "inputs": f"Request {name}:",
            "parameters": {"max_new_tokens": tokens, "adapter_id": adapter},
        }
        try:
            with httpx.stream("POST", server.url + "/generate_stream", json=body, timeout=300) as r:
                r.raise_for_status()
                for line in r.iter_lines():
                    if line.startswith("data:") and name in first_token:
                        first_token[name].set()
            ended[name] = time.monotonic()
        except BaseException as exc:
            errors.append(exc)

    try:
        started = time.monotonic()
        threads = [
            threading.Thread(target=send, args=(f"long-{i}", names[i], LONG_TOKENS))
            for i in range(6)
        ]
        for thread in threads:
            thread.start()
        # two long requests stream, one in each seat; the other four wait for a seat
        deadline = time.monotonic() + 120
        while sum(e.is_set() for e in first_token.values()) < 2 and time.monotonic() < deadline:
            time.sleep(0.005)
        assert sum(e.is_set() for e in first_token.values()) >= 2, errors
        short = threading.Thread(target=send, args=("short", names[6], 4))
        short.start()
        for thread in [*threads, short]:
            thread.join(300)
        assert not errors, errors
        longs = [ended[f"long-{i}"] - started for i in range(6)]
        took = ended["short"] - started
        print(f"short request ended at {took:.2f} s; the long ones at {min(longs):.2f} s and on")
        assert took < min(longs), "the short request waited for whole long requests"
        held = metric_samples(server.url)["lora_guard_request_held_ms_count"]
        assert held == [({}, 7.0)], "every finished request's hold-back is counted"
    finally:
        assert server.stop() == 0, (tmp_path / "server.log").read_text()
