"""The FastAPI application: routes, the error table, and the engine's lifetime."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse

from lora_guard import __version__
from lora_guard.server import errors, routes_admin, routes_openai, routes_tgi, routes_tokens
from lora_guard.server.errors import APIError
from lora_guard.server.state import ServerState

OPEN_PATHS = frozenset({"/health", "/info"})  # probes; /metrics needs an admin key


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
    app.include_router(routes_tgi.router)
    app.include_router(routes_openai.router)
    app.include_router(routes_tokens.router)
    app.include_router(routes_admin.router)

    @app.middleware("http")
    async def authenticate(
        request: Request, call_next: Callable[[Request], Awaitable[Response]]
    ) -> Response:
        if state.keys is not None and request.url.path not in OPEN_PATHS:
            try:
                request.state.api_key = state.keys.authenticate(
                    request.headers.get("authorization")
                )
            except APIError as exc:
                return JSONResponse(exc.body(), status_code=exc.status)
        return await call_next(request)

    return app
