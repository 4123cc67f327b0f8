"""The FastAPI application: routes, the error table, and the engine's lifetime."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from lora_guard import __version__
from lora_guard.server import errors, routes_openai, routes_tgi
from lora_guard.server.state import ServerState


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
    return app
