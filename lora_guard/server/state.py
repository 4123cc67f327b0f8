"""What the routes share: the engine, its tokenizer, the limits and the keys; and the way into
the engine and back."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import Request

from lora_guard.engine.async_engine import AsyncEngine
from lora_guard.engine.outputs import JsonLog, RequestOutput
from lora_guard.engine.sampling import SamplingParams
from lora_guard.server.errors import ENGINE_ERRORS, from_engine, generation, overloaded, unavailable


@dataclass
class Limits:
    max_concurrent_requests: int
    max_input_tokens: int
    max_total_tokens: int
    max_stop_sequences: int = 4


@dataclass
class ServerState:
    engine: AsyncEngine
    limits: Limits
    in_flight: int = 0
    metrics: Any = None
    ready: bool = True
    keys: Any = None  # a KeyRing when --api-key-file is set
    adapter_dirs: list[Path] = field(default_factory=list)
    request_log: JsonLog = field(default_factory=lambda: JsonLog.open(None))  # --request-log

    @property
    def llm(self) -> Any:
        return self.engine.engine

    @property
    def tokenizer(self) -> Any:
        return self.engine.engine.tokenizer

    @property
    def model_id(self) -> str:
        return str(self.engine.engine.model_id)

    async def generate(
        self,
        prompt: list[int],
        params: SamplingParams,
        adapter_id: str | None,
        tenant_id: str,
        *,
        openai: bool = False,
        arrival: float | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """The engine's outputs for one request; failures become :class:`APIError` (the engine's
        own through :data:`ENGINE_ERRORS`, answered as the OpenAI routes do when ``openai``).
        ``arrival`` is when the server received it (on the engine's clock), if known."""
        if not self.engine.is_alive:
            raise unavailable("the engine is not running")
        if self.in_flight >= self.limits.max_concurrent_requests:
            raise overloaded("Model is overloaded", 1.0)
        self.in_flight += 1
        try:
            stream = self.engine.generate(
                prompt, params, adapter_id, tenant_id=tenant_id, arrival_time=arrival
            )
            try:
                async for out in stream:
                    if out.error is not None:
                        if out.retry_after is not None:
                            raise overloaded(out.error, out.retry_after)
                        raise generation(out.error)
                    yield out
            except tuple(ENGINE_ERRORS) as exc:
                raise from_engine(exc, openai=openai) from None
            finally:
                await stream.aclose()
        finally:
            self.in_flight -= 1


def state_of(request: Request) -> ServerState:
    state: ServerState = request.app.state.lora_guard
    return state
