"""One table from failures to HTTP answers, in TGI's error body ``{"error", "error_type"}``."""

from __future__ import annotations

import math

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from lora_guard.engine.async_engine import EngineDeadError
from lora_guard.engine.errors import RequestError, UnknownAdapterError


class APIError(Exception):
    """A request ends with ``status`` and TGI's error body."""

    def __init__(
        self, status: int, error: str, error_type: str, retry_after: float | None = None
    ) -> None:
        super().__init__(error)
        self.status, self.error, self.error_type, self.retry_after = (
            status,
            error,
            error_type,
            retry_after,
        )

    def body(self) -> dict[str, str]:
        return {"error": self.error, "error_type": self.error_type}

    def headers(self) -> dict[str, str]:
        if self.retry_after is None:
            return {}
        return {"Retry-After": str(max(1, math.ceil(self.retry_after)))}


def validation(message: str) -> APIError:
    return APIError(422, message, "validation")


def not_found(message: str) -> APIError:
    return APIError(404, message, "not_found")


def overloaded(message: str, retry_after: float) -> APIError:
    return APIError(429, message, "overloaded", retry_after)


def generation(message: str) -> APIError:
    return APIError(424, message, "generation")


def unavailable(message: str) -> APIError:
    return APIError(503, message, "unhealthy")


# The engine's refusals: (status, error_type) on the TGI routes, then on the OpenAI routes.
ENGINE_ERRORS: dict[type[Exception], tuple[tuple[int, str], tuple[int, str]]] = {
    UnknownAdapterError: ((422, "validation"), (404, "not_found")),
    RequestError: ((422, "validation"), (422, "validation")),
    EngineDeadError: ((500, "incomplete_generation"), (500, "incomplete_generation")),
}


def from_engine(exc: Exception, *, openai: bool = False) -> APIError:
    """The answer to an exception of a kind in :data:`ENGINE_ERRORS`."""
    kind = next(k for k in type(exc).__mro__ if k in ENGINE_ERRORS)
    tgi, openai_ = ENGINE_ERRORS[kind]
    status, error_type = openai_ if openai else tgi
    return APIError(status, str(exc), error_type)


def install(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_request: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers())

    @app.exception_handler(HTTPException)
    async def http_error(_request: Request, exc: HTTPException) -> JSONResponse:
        # A body that is not JSON at all: a validation error, in TGI's shape.
        status = 422 if exc.status_code == 400 else exc.status_code
        error_type = "validation" if status == 422 else "http"
        body = {"error": str(exc.detail), "error_type": error_type}
        return JSONResponse(body, status_code=status, headers=getattr(exc, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def bad_body(_request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        message = f"`{where}`: {first.get('msg', 'invalid')}" if where else "invalid request body"
        return JSONResponse({"error": message, "error_type": "validation"}, status_code=422)
