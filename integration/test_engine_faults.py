"""Engine faults injected into a running server (faults.py, triggered by the tenant): a failing
step fails only its requests with 424 and frees their blocks; a plugin fault is contained; a dead
engine loop turns /health 503 and ends the requests in flight with an error instead of a hang;
beyond --max-concurrent-requests the answer is 429 with Retry-After."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from lora_guard.demo.scrape import metric
from lora_guard.demo.testing import ServerProcess, eventually, start_server

MAX_CONCURRENT = 4
ServesCorrectly = Callable[..., None]


def post(url: str, tenant: str, route: str = "/generate", **parameters: Any) -> httpx.Response:
    body = {"inputs": "The capital of France is", "parameters": {"max_new_tokens": 8, **parameters}}
    return httpx.post(url + route, json=body, headers={"X-Tenant-Id": tenant}, timeout=60)


def idle(url: str) -> bool:
    return (
        metric(url, "vllm:num_requests_running") == 0
        and metric(url, "vllm:kv_cache_usage_perc") == 0
    )


class Background:
    """Requests sent on threads; each answer (or the exception) is kept in ``results``."""

    def __init__(self) -> None:
        self.results: list[httpx.Response | BaseException] = []
        self.threads: list[threading.Thread] = []

    def send(self, request: Callable[[], httpx.Response]) -> None:
        def run() -> None:
            try:
                self.results.append(request())
            except BaseException as exc:  # kept for the assertion
                self.results.append(exc)

        thread = threading.Thread(target=run)
        thread.start()
        self.threads.append(thread)

    def join(self, timeout: float) -> list[httpx.Response | BaseException]:
        deadline = time.monotonic() + timeout
        for thread in self.threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        assert not any(t.is_alive() for t in self.threads), "a request hung"
        return self.results


def start_faulty(
    tiny: tuple[Path, Path], root: Path, fault_env: Callable[[Path], dict[str, str]]
) -> tuple[ServerProcess, Path]:
    model, adapters = tiny
    hold = root / "hold"
    server = start_server(
        model,
        adapters,
        "--plugin",
        "faults:injector",
        "--cold-loads-per-minute",
        "1000",
        "--max-concurrent-requests",
        str(MAX_CONCURRENT),
        log=root / "server.log",
        env=fault_env(hold),
    )
    return server, hold


@pytest.fixture(scope="module")
def faulty(
    tiny: tuple[Path, Path],
    tmp_path_factory: pytest.TempPathFactory,
    fault_env: Callable[[Path], dict[str, str]],
) -> Iterator[tuple[ServerProcess, Path]]:
    server, hold = start_faulty(tiny, tmp_path_factory.mktemp("faulty"), fault_env)
    yield server, hold
    assert server.stop() == 0


def test_a_failing_step_fails_its_requests_with_424_and_the_loop_goes_on(
    faulty: tuple[ServerProcess, Path], serves_correctly: ServesCorrectly
) -> None:
    server, _ = faulty
    for route in ("/generate", "/generate_stream"):
        for adapter in (None, "a-00"):
            r = post(server.url, "fault-step", route, adapter_id=adapter)
            assert r.status_code == 424, r.text
            assert r.json()["error_type"] == "generation"
            assert "injected fault: the forward pass failed" in r.json()["error"]
    eventually(lambda: idle(server.url), timeout_s=20, what="the failed requests' blocks freed")
    assert metric(server.url, "tgi_request_failure", err="error") >= 4
    assert httpx.get(server.url + "/health").status_code == 200
    serves_correctly(server.url)


def test_a_request_sharing_the_failing_step_fails_with_it_and_frees_its_blocks(
    faulty: tuple[ServerProcess, Path], serves_correctly: ServesCorrectly
) -> None:
    server, _ = faulty
    # This prompt runs to its 400 tokens on the tiny model (no early EOS), so the fault's step
    # is sure to find it running.
    body = {"inputs": "A LoRA adapter changes the " * 3, "parameters": {"max_new_tokens": 400}}
    with httpx.stream("POST", server.url + "/generate_stream", json=body, timeout=60) as stream:
        lines = stream.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))  # it is running
        assert metric(server.url, "vllm:kv_cache_usage_perc") > 0
        r = post(server.url, "fault-step")
        assert r.status_code == 424, r.text
        rest = [line for line in lines if line.startswith("data:")]
    assert "injected fault: the forward pass failed" in rest[-1]  # its last event: the error
    assert '"error_type": "generation"' in rest[-1]
    eventually(lambda: idle(server.url), timeout_s=20, what="every block to be freed")
    serves_correctly(server.url, adapters=[None])


def test_a_plugin_that_raises_is_contained_and_the_request_served(
    faulty: tuple[ServerProcess, Path], serves_correctly: ServesCorrectly
) -> None:
    server, hold = faulty
    reference = post(server.url, "default", adapter_id="a-01")
    r = post(server.url, "fault-plugin", adapter_id="a-01")
    assert r.status_code == 200, r.text
    tokens, expected = r.json()["details"]["tokens"], reference.json()["details"]["tokens"]
    assert [t["id"] for t in tokens] == [t["id"] for t in expected]
    assert [t["logprob"] for t in tokens] == pytest.approx([t["logprob"] for t in expected])
    assert "plugin fault in lora_guard_batch_form" in (hold.parent / "server.log").read_text()
    assert httpx.get(server.url + "/health").status_code == 200
    serves_correctly(server.url, adapters=["a-01"])


def test_a_busy_answer_from_a_policy_is_429_with_its_retry_after(
    faulty: tuple[ServerProcess, Path], tiny: tuple[Path, Path], serves_correctly: ServesCorrectly
) -> None:
    server, _ = faulty
    # Registered again, a-02 is cold: its load is asked of the policies, which say busy.
    admin = {"lora_name": "a-02", "lora_path": str(tiny[1] / "a-02")}
    for route in ("/v1/unload_lora_adapter", "/v1/load_lora_adapter"):
        assert httpx.post(server.url + route, json=admin, timeout=30).status_code == 200
    r = post(server.url, "busy", adapter_id="a-02")
    assert r.status_code == 429, r.text
    assert r.json()["error_type"] == "overloaded" and "busy" in r.json()["error"]
    assert r.headers["Retry-After"] == "3"  # 2.5 s, rounded up
    serves_correctly(server.url, adapters=["a-02"])


def test_beyond_max_concurrent_requests_the_answer_is_429_with_retry_after(
    faulty: tuple[ServerProcess, Path], serves_correctly: ServesCorrectly
) -> None:
    server, hold = faulty
    held = Background()
    hold.touch()
    try:
        for i in range(MAX_CONCURRENT):
            held.send(lambda i=i: post(server.url, "hold", adapter_id=f"a-0{i % 3}"))
        count = Path(str(hold) + ".count")
        eventually(
            lambda: count.exists() and count.read_text() == str(MAX_CONCURRENT),
            timeout_s=20,
            what=f"{MAX_CONCURRENT} requests held in flight",
        )
        for route in ("/generate", "/generate_stream"):
            r = post(server.url, "default", route)
            assert r.status_code == 429, r.text
            assert r.json()["error_type"] == "overloaded"
            assert int(r.headers["retry-after"]) >= 1
    finally:
        hold.unlink()
    answers = held.join(60)
    assert [a.status_code for a in answers if isinstance(a, httpx.Response)] == [200] * 4, answers
    eventually(lambda: idle(server.url), timeout_s=20, what="the server to be idle")
    serves_correctly(server.url, adapters=[None, "a-00"])


def test_a_dead_engine_loop_turns_health_503_and_ends_requests_in_flight(
    tiny: tuple[Path, Path], tmp_path: Path, fault_env: Callable[[Path], dict[str, str]]
) -> None:
    server, hold = start_faulty(tiny, tmp_path, fault_env)
    try:
        hold.touch()  # two requests in flight, waiting, when the loop dies
        in_flight = Background()
        in_flight.send(lambda: post(server.url, "hold", "/generate"))
        in_flight.send(lambda: post(server.url, "hold", "/generate_stream"))
        count = Path(str(hold) + ".count")
        eventually(
            lambda: count.exists() and count.read_text() == "2",
            timeout_s=20,
            what="2 requests held",
        )

        r = post(server.url, "fault-loop")
        assert r.status_code == 500, r.text
        assert r.json()["error_type"] == "incomplete_generation"
        assert "the engine loop died" in r.json()["error"]
        for answer in in_flight.join(10):  # an error, not a hang
            assert isinstance(answer, httpx.Response), answer
            assert answer.status_code == 500, answer.text
            assert "the engine loop died" in answer.json()["error"]

        health = httpx.get(server.url + "/health")
        assert health.status_code == 503 and health.json()["error_type"] == "unhealthy"
        r = post(server.url, "default")
        assert r.status_code == 503, r.text
        assert "engine" in r.json()["error"]
    finally:
        assert server.stop() == 0
    assert "engine loop died" in (tmp_path / "server.log").read_text()
