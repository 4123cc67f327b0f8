"""The cold-load budget at vLLM's door, the tenant passed in, and lora-guard's metrics on vLLM's
``/metrics``: an ASGI middleware (``vllm serve ... --middleware lora_guard.vllm.Door``) beside
``--scheduler-cls lora_guard.vllm.AsyncScheduler``.

A completion for an adapter that is not in a device seat, when every seat holds an adapter that
requests still need, makes vLLM's worker evict one of them: thrash, which the cold-load budget
allows ``cold_loads_per_minute`` times a minute. When the budget's window would not have room for
the load within ``cold_queue_timeout`` seconds (the loads queued ahead of it counted), the door
answers 429 with ``Retry-After``: the seconds until the window has room. A request for an adapter
whose load is already queued rides that load and goes in. Each 429 is counted by the scheduler as
a rejected cold load. The seats and loads are the scheduler's (``lora_guard.vllm.channel``); a
door without the scheduler lets everything in.

The tenant (bearer token's digest and ``X-Tenant-Id``, as ``KVScope`` reads it) goes to the
scheduler in ``vllm_xargs``, for the tenant share of hot-set admission.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
from pathlib import Path
from typing import Any

from lora_guard.clock import wall
from lora_guard.plugins.manager import Hooks
from lora_guard.policies.cold_budget import ColdLoadBudget
from lora_guard.vllm import channel
from lora_guard.vllm.guard import TENANT_ARG
from lora_guard.vllm.kv_scope import (
    SALTED_PATHS,
    ASGIApp,
    Receive,
    Scope,
    Send,
    header_map,
    read_body,
    replay,
    served_models,
    sized,
    tenant_of,
)
from lora_guard.vllm.settings import configured_hooks

ADMITTED_S = 5.0  # at most this long between the door and the scheduler's queue
FRESH_METRICS_S = 0.5  # the longest /metrics waits for a busy scheduler to render its families


class Door:
    """ASGI middleware: 429 for thrash over the cold-load budget, tenants to the scheduler,
    lora-guard's metrics appended to ``/metrics``."""

    def __init__(
        self, app: ASGIApp, hooks: Hooks | None = None, folder: Path | None = None
    ) -> None:
        self.app = app
        hooks = hooks if hooks is not None else configured_hooks()[0]
        budget = hooks.pm.get_plugin("cold-budget")
        self.budget = budget if isinstance(budget, ColdLoadBudget) else None
        self.folder = folder if folder is not None else channel.channel_dir(os.getpid())
        self.seats = channel.FileWatch(self.folder / channel.SEATS_FILE)
        self.metrics = channel.FileWatch(self.folder / channel.METRICS_FILE)
        self.admitted: dict[str, float] = {}  # adapters let in for a load, and when

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
        elif scope["method"] == "GET" and scope["path"].rstrip("/") == "/metrics":
            await self._metrics(scope, receive, send)
        elif scope["method"] == "POST" and scope["path"] in SALTED_PATHS:
            await self._completion(scope, receive, send)
        else:
            await self.app(scope, receive, send)

    # completions
    async def _fresh_metrics(self) -> None:
        asked = wall()
        channel.replace_file(self.folder / channel.WANTED_FILE, b"")
        if not self.seats.json().get("busy"):
            return
        deadline = asked + FRESH_METRICS_S
        while channel.mtime(self.metrics.path) < asked and wall() < deadline:
            await asyncio.sleep(0.01)

    async def _completion(self, scope: Scope, receive: Receive, send: Send) -> None:
        body, more = await read_body(receive)
        payload = None
        if not more:
            try:
                payload = json.loads(body)
            except ValueError:
                payload = None
        if not isinstance(payload, dict):  # vLLM's to answer
            await self.app(scope, replay(body, receive, more), send)
            return
        headers = header_map(scope)
        tenant = tenant_of(headers)
        adapter = self._adapter(scope, payload.get("model"))
        wait = self.wait(adapter, wall()) if adapter is not None else None
        if wait is not None:
            reason = (
                f"adapter {adapter!r} is not resident and the cold-load budget is spent: "
                f"retry in {wait:.1f} s"
            )
            channel.append_line(
                self.folder / channel.REJECTS_FILE,
                {
                    "time": wall(),
                    "request_id": headers.get("x-request-id", ""),
                    "adapter_id": adapter,
                    "tenant_id": tenant,
                    "retry_after": wait,
                    "reason": reason,
                },
            )
            await _too_many(send, reason, wait)
            return
        extra = payload.get("vllm_xargs")
        if extra is None or isinstance(extra, dict):
            payload["vllm_xargs"] = {**(extra or {}), TENANT_ARG: tenant}
        body = json.dumps(payload).encode()
        scope = {**scope, "headers": sized(scope["headers"], body)}
        await self.app(scope, replay(body, receive), send)

    @staticmethod
    def _adapter(scope: Scope, model: Any) -> str | None:
        models = served_models(scope)
        if models is None or not isinstance(model, str):
            return None
        return model if model in models.lora_requests else None

    def wait(self, adapter: str, now: float) -> float | None:
        """Seconds until the budget has room for ``adapter``'s load, when that is longer than
        the budget's queue timeout; None to let the request in."""
        seats = self.seats.json()
        if self.budget is None or not seats or adapter in seats["device"]:
            return None
        # an adapter let in counts until the scheduler shows its request, or for ADMITTED_S
        shown = set(seats["waiting_out"]) | set(seats["device"])
        self.admitted = {
            a: t
            for a, t in self.admitted.items()
            if now - t < ADMITTED_S and not (a in shown and seats["time"] > t)
        }
        queued = set(seats["waiting_out"]) | set(self.admitted)
        if adapter in queued:
            return None  # its load is queued already: it rides that one
        device, needed = seats["device"], set(seats["needed"])
        # seats free or held by adapters no request needs: loads into them are no thrash
        idle = seats["max_loras"] - len(device) + sum(a not in needed for a in device)
        place = len(queued) - idle  # evicting loads queued ahead of this one
        if place >= 0:
            wait = self.budget.retry_after(seats["evicting_loads"], now, place=place)
            if wait > self.budget.queue_timeout_s:
                return wait
        self.admitted[adapter] = now
        return None

    # metrics
    async def _metrics(self, scope: Scope, receive: Receive, send: Send) -> None:
        """vLLM's exposition with lora-guard's families after it (uncompressed). The scheduler
        renders them when asked: a busy engine within a step, an idle one rendered them when it
        went idle."""
        await self._fresh_metrics()
        start: dict[str, Any] = {}
        chunks: list[bytes] = []

        async def append(message: Any) -> None:
            if message["type"] == "http.response.start":
                start.update(message)
                return
            if message["type"] != "http.response.body":
                await send(message)
                return
            chunks.append(message.get("body", b""))
            if message.get("more_body", False):
                return
            body = b"".join(chunks)
            if start.get("status") == 200:
                body += without_families(self.metrics.read(), families(body))
            await send({**start, "headers": sized(start.get("headers", []), body)})
            await send({"type": "http.response.body", "body": body})

        plain = [(k, v) for k, v in scope["headers"] if k.lower() != b"accept-encoding"]
        await self.app({**scope, "headers": plain}, receive, append)


def families(exposition: bytes) -> set[bytes]:
    """The metric families a Prometheus text exposition declares."""
    return {
        line.split(b" ", 3)[2]
        for line in exposition.splitlines()
        if line.startswith(b"# TYPE ") and line.count(b" ") >= 3
    }


def without_families(exposition: bytes, names: set[bytes]) -> bytes:
    """``exposition`` less the families in ``names`` (those vLLM serves itself win)."""
    if not names:
        return exposition
    kept, keep = [], True
    for line in exposition.splitlines(keepends=True):
        if line.startswith((b"# HELP ", b"# TYPE ")):
            keep = line.split(b" ", 3)[2] not in names
        elif not line.startswith(b"#"):
            sample = line.split(b"{", 1)[0].split(b" ", 1)[0]
            keep = not any(sample == n or sample.startswith(n + b"_") for n in names)
        if keep:
            kept.append(line)
    return b"".join(kept)


async def _too_many(send: Send, reason: str, wait: float) -> None:
    body = json.dumps(
        {"error": {"message": reason, "type": "overloaded", "param": None, "code": 429}}
    ).encode()
    await send(
        {
            "type": "http.response.start",
            "status": 429,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"retry-after", str(math.ceil(wait)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
