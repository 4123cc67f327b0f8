"""One HTTP request through an ASGI application in this process, its answer as it comes.

The ingress forwards each request (``Forwarded``) to an engine replica, which runs it through
lora-guard's own FastAPI application with :func:`call_app`: the same routes, validation, errors
and SSE as ``lora-guard serve``. The first item yielded is the status and headers, then the body
in the pieces the application sent. Closing the generator early (a client gone) tells the
application the client disconnected, which aborts its request in the engine.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)
_FINISH_S = 5.0  # how long a closed request's application gets to finish


@dataclass(frozen=True)
class Forwarded:
    method: str
    path: str
    query: bytes = b""
    headers: list[tuple[str, str]] = field(default_factory=list)
    body: bytes = b""


@dataclass(frozen=True)
class Head:
    status: int
    headers: list[tuple[str, str]]


async def call_app(app: Any, request: Forwarded) -> AsyncIterator[Head | bytes]:
    """Run ``request`` through the ASGI ``app``: its :class:`Head`, then its body pieces."""
    messages: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
    disconnected = asyncio.Event()
    body_sent = False

    async def receive() -> dict[str, Any]:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": request.body, "more_body": False}
        await disconnected.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        await messages.put(message)

    async def run() -> None:
        try:
            await app(_scope(request), receive, send)
        except Exception:
            log.exception("the application failed on %s %s", request.method, request.path)
        finally:
            await messages.put(None)

    task = asyncio.create_task(run())
    started = False
    try:
        while (message := await messages.get()) is not None:
            if message["type"] == "http.response.start":
                started = True
                headers = [
                    (k.decode("latin-1"), v.decode("latin-1"))
                    for k, v in message.get("headers", [])
                ]
                yield Head(int(message["status"]), headers)
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield bytes(message["body"])
                if not message.get("more_body", False):
                    break
        if not started:  # the application failed before it answered
            yield Head(500, [("content-type", "application/json")])
            yield b'{"error":"the engine replica failed on this request","error_type":"generation"}'
    finally:
        disconnected.set()
        try:
            await asyncio.wait_for(task, _FINISH_S)
        except asyncio.TimeoutError:
            log.warning("the application did not finish %s %s", request.method, request.path)


def _scope(request: Forwarded) -> dict[str, Any]:
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": request.method,
        "scheme": "http",
        "path": request.path,
        "raw_path": request.path.encode(),
        "query_string": request.query,
        "root_path": "",
        "headers": [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in request.headers],
        "client": ("127.0.0.1", 0),
        "server": ("127.0.0.1", 0),
        "state": {},
    }
