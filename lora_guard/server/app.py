"""The FastAPI application: routes, the error table, and the engine's lifetime."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from lora_guard import __version__
from lora_guard.server import errors, routes_admin, routes_openai, routes_tgi, routes_tokens
from lora_guard.server.errors import APIError
from lora_guard.server.request_log import RequestTimes
from lora_guard.server.state import ServerState

OPEN_PATHS = frozenset({"/health", "/info"})  # probes; /metrics needs an admin key
ROUTERS = (routes_tgi.router, routes_openai.router, routes_tokens.router, routes_admin.router)


def create_app(state: ServerState) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        if not state.engine.is_alive:
            state.engine.start()
        try:
            yield
        finally:
            state.ready = False
            state.engine.shutdown()

    app = FastAPI(title="lora-guard", version=__version__, lifespan=lifespan)
    app.state.lora_guard = state
    errors.install(app)
    for router in ROUTERS:
        app.include_router(router)
    app.add_middleware(Door, state=state)
    return app


class Door:
    """Every HTTP request's first stop: stamps its arrival (``request.state.arrival``, the
    engine's clock, which its TTFT and queue time count from) and, when API keys are
    configured, authenticates it (``request.state.api_key``); once a generation's answer is
    written, its times go to the request log (``--request-log``). A plain ASGI middleware, so
    that streamed answers pass through untouched."""

    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        self.app, self.state = app, state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            seen = scope.setdefault("state", {})
            seen["arrival"] = self.state.engine.clock()
            if self.state.keys is not None and scope["path"] not in OPEN_PATHS:
                header = Request(scope).headers.get("authorization")
                try:
                    seen["api_key"] = self.state.keys.authenticate(header)
                except APIError as exc:
                    await JSONResponse(exc.body(), status_code=exc.status)(scope, receive, send)
                    return
        if scope["type"] != "http" or not self.state.request_log.writing:
            await self.app(scope, receive, send)
            return
        ended: list[float] = []

        async def sending(message: Message) -> None:
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body"):
                ended.append(self.state.engine.clock())  # the last byte handed to the socket

        await self.app(scope, receive, sending)
        self._log(scope, ended[0] if ended else self.state.engine.clock())

    def _log(self, scope: Scope, ended: float) -> None:
        run = scope["state"].get("run")
        if run is None or run.last is None:
            return  # not a generation, or refused before the engine took it
        total = ended - scope["state"]["arrival"]
        client_id = Request(scope).headers.get("x-request-id")
        self.state.request_log.write(RequestTimes.of(run.last, total, scope["path"], client_id))
