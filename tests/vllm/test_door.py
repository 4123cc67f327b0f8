"""The door in front of vLLM: 429 with a true ``Retry-After`` for a load that would thrash over
the cold-load budget, the tenant passed on, lora-guard's metrics after vLLM's. The seats file is
written as the scheduler writes it; vLLM's app is an echo app holding vLLM's registry of served
models. The door inside a real vLLM is ``integration/test_vllm_scheduler.py``."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

from lora_guard.plugins.manager import Hooks, make_plugin_manager
from lora_guard.vllm import channel
from lora_guard.vllm.door import FRESH_METRICS_S, Door, families, without_families
from lora_guard.vllm.guard import TENANT_ARG

NOW = time.time()
ADAPTERS = [f"a{i}" for i in range(8)]


def seats(device: list[str], needed: list[str], loads: list[float], **more: Any) -> bytes:
    record = {
        "max_loras": 4,
        "device": device,
        "host": device,
        "needed": needed,
        "waiting_out": [],
        "evicting_loads": loads,
        "time": NOW,
        **more,
    }
    return json.dumps(record).encode()


def budget(per_minute: int = 1, timeout_s: float = 0.0) -> Hooks:
    hooks = Hooks(make_plugin_manager("cold-budget"))
    hooks.configure({"cold_loads_per_minute": per_minute, "cold_queue_timeout": timeout_s})
    return hooks


def door(folder: Path, per_minute: int = 1) -> Door:
    async def nothing(scope: Any, receive: Any, send: Any) -> None:
        raise AssertionError("the wait is asked of the door alone")

    return Door(nothing, hooks=budget(per_minute), folder=folder)


def vllm_app(folder: Path) -> Starlette:
    """An app that echoes completions and serves a ``/metrics`` of its own, holding vLLM's
    registry of served models, with the door added as vLLM adds ``--middleware``."""

    async def echo(request: Request) -> Response:
        return Response(await request.body(), media_type="application/json")

    async def metrics(request: Request) -> Response:
        return PlainTextResponse("vllm:num_requests_running 0.0\n")

    app = Starlette(
        routes=[
            Route("/v1/completions", echo, methods=["POST"]),
            Route("/metrics", metrics),
        ]
    )
    app.state.openai_serving_models = SimpleNamespace(lora_requests={a: None for a in ADAPTERS})
    app.add_middleware(Door, hooks=budget(), folder=folder)
    return app


BUSY = ["a0", "a1", "a2", "a3"]  # every seat held by an adapter requests need


@pytest.mark.parametrize(
    ("device", "needed", "loads", "admitted"),
    [
        (BUSY, BUSY, [NOW - 10], False),  # a thrash load, the minute's budget spent
        (BUSY, BUSY, [], True),  # the budget has room
        (BUSY, ["a0", "a1", "a2"], [NOW - 10], True),  # a3's seat is idle: no thrash
        (BUSY[:3], BUSY[:3], [NOW - 10], True),  # a free seat
    ],
)
def test_the_door_refuses_only_a_thrash_load_over_the_budget(
    tmp_path: Path, device: list[str], needed: list[str], loads: list[float], admitted: bool
) -> None:
    (tmp_path / channel.SEATS_FILE).write_bytes(seats(device, needed, loads))
    wait = door(tmp_path).wait("a5", NOW)
    assert (wait is None) == admitted
    if not admitted:
        assert wait == pytest.approx(50.0, abs=0.01)  # the load of 10 s ago leaves the window


def test_loads_queued_ahead_count_and_a_request_rides_a_queued_load(tmp_path: Path) -> None:
    (tmp_path / channel.SEATS_FILE).write_bytes(seats(BUSY, BUSY, [], waiting_out=["a4"]))
    guard = door(tmp_path, per_minute=2)
    assert guard.wait("a4", NOW) is None  # a4's load is queued: it rides it
    assert guard.wait("a5", NOW) is None  # the second load of the minute
    assert guard.wait("a5", NOW) is None  # a5 again: queued now
    assert guard.wait("a6", NOW) == pytest.approx(60.0)  # two queued ahead: the next minute


def call(
    app: Starlette, method: str, path: str, body: dict[str, Any] | None = None
) -> httpx.Response:
    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://door") as client:
            headers = {"X-Tenant-Id": "acme"}
            return await client.request(method, path, json=body, headers=headers)

    return asyncio.run(go())


def test_a_refused_request_gets_429_retry_after_and_is_counted(tmp_path: Path) -> None:
    (tmp_path / channel.SEATS_FILE).write_bytes(seats(BUSY, BUSY, [time.time() - 10]))
    reply = call(vllm_app(tmp_path), "POST", "/v1/completions", {"model": "a5", "prompt": "x"})
    assert reply.status_code == 429
    assert 49 <= int(reply.headers["Retry-After"]) <= 51
    assert "cold-load budget" in reply.json()["error"]["message"]
    (line,) = channel.take_lines(tmp_path / channel.REJECTS_FILE)
    assert line["adapter_id"] == "a5" and line["tenant_id"] == "acme"


def test_an_admitted_request_carries_its_tenant_and_keeps_its_own_args(tmp_path: Path) -> None:
    body = {"model": "a1", "prompt": "x", "vllm_xargs": {"mine": 1}}
    reply = call(vllm_app(tmp_path), "POST", "/v1/completions", body)
    assert reply.status_code == 200
    assert reply.json()["vllm_xargs"] == {"mine": 1, TENANT_ARG: "acme"}


def test_metrics_are_vllms_then_lora_guards(tmp_path: Path) -> None:
    (tmp_path / channel.METRICS_FILE).write_bytes(b"lora_guard_hot_adapter_hit_rate 0.5\n")
    reply = call(vllm_app(tmp_path), "GET", "/metrics")
    assert reply.text == "vllm:num_requests_running 0.0\nlora_guard_hot_adapter_hit_rate 0.5\n"
    assert int(reply.headers["content-length"]) == len(reply.content)


def test_a_family_vllm_serves_itself_is_left_to_vllm() -> None:
    ours = (
        b"# HELP vllm:lora_adapter_loaded loaded\n# TYPE vllm:lora_adapter_loaded gauge\n"
        b'vllm:lora_adapter_loaded{adapter_name="a"} 1.0\n'
        b"# HELP lora_guard_memory_watermark share\n# TYPE lora_guard_memory_watermark gauge\n"
        b"lora_guard_memory_watermark 0.5\n"
    )
    theirs = b"# TYPE vllm:lora_adapter_loaded gauge\n"
    assert families(theirs) == {b"vllm:lora_adapter_loaded"}
    kept = without_families(ours, families(theirs))
    assert b"vllm:lora_adapter_loaded" not in kept and b"lora_guard_memory_watermark 0.5" in kept
    assert without_families(ours, set()) == ours


def test_a_read_of_metrics_asks_the_scheduler_to_render_them(tmp_path: Path) -> None:
    (tmp_path / channel.METRICS_FILE).write_bytes(b"lora_guard_hot_adapter_hit_rate 0.5\n")
    before = time.time()
    call(vllm_app(tmp_path), "GET", "/metrics")  # an idle engine (no seats file): no wait
    assert channel.mtime(tmp_path / channel.WANTED_FILE) >= before - 1
    assert time.time() - before < FRESH_METRICS_S
