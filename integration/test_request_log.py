"""``--request-log``: a real server writes one line a generation request, keyed by the client's
X-Request-Id, whose parts (queue, steps, between steps, HTTP) add up to the request's time in
the server; what the client measured is that time and a little more."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest

from lora_guard.demo.testing import start_server


def test_each_generation_gets_a_line_whose_parts_add_up(
    tiny: tuple[Path, Path], tmp_path: Path
) -> None:
    model, adapters = tiny
    log = tmp_path / "requests.jsonl"
    server = start_server(model, adapters, "--request-log", str(log), log=tmp_path / "server.log")
    try:
        with httpx.Client(base_url=server.url, timeout=60) as http:
            taken = {}
            for i, (path, body) in enumerate(
                [
                    ("/generate", {"inputs": "Hello", "parameters": {"max_new_tokens": 5}}),
                    (
                        "/generate_stream",
                        {"inputs": "Hi there", "parameters": {"max_new_tokens": 6}},
                    ),
                    (
                        "/v1/completions",
                        {"model": "a-01", "prompt": "Once", "max_tokens": 4, "stream": True},
                    ),
                ]
            ):
                started = time.perf_counter()
                with http.stream("POST", path, json=body, headers={"X-Request-Id": f"c{i}"}) as r:
                    assert r.status_code == 200, r.read()
                    r.read()
                taken[f"c{i}"] = time.perf_counter() - started
            http.get("/health")  # not a generation: no line
            missing = http.post(
                "/generate", json={"inputs": "x", "parameters": {"max_new_tokens": 0}}
            )
            assert missing.status_code == 422  # refused before the engine: no line
        lines = [json.loads(line) for line in log.read_text().splitlines()]
    finally:
        assert server.stop() == 0
    assert [line["id"] for line in lines] == ["c0", "c1", "c2"]
    assert [line["route"] for line in lines] == ["/generate", "/generate_stream", "/v1/completions"]
    assert [line["generated_tokens"] for line in lines] == [5, 6, 4]
    for line in lines:
        parts = line["queue_s"] + line["step_s"] + line["between_steps_s"] + line["http_s"]
        assert parts == pytest.approx(line["total_s"], abs=1e-9)
        assert min(line["queue_s"], line["step_s"], line["between_steps_s"], line["http_s"]) >= 0
        assert line["step_s"] > 0 and line["finish_reason"] == "length"
        # the client's time holds the server's, up to the few microseconds between the server
        # handing its last bytes to the socket and reading its clock
        assert line["total_s"] <= taken[line["id"]] + 0.005


def test_a_log_that_cannot_be_written_stops_the_server_at_start(
    tiny: tuple[Path, Path], tmp_path: Path
) -> None:
    model, adapters = tiny
    with pytest.raises(RuntimeError, match="request_log: cannot write"):
        start_server(
            model,
            adapters,
            "--request-log",
            str(tmp_path / "no-such-dir" / "requests.jsonl"),
            log=tmp_path / "server.log",
            ready_s=60,
        )
