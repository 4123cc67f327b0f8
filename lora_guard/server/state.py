"""What the routes share: the engine, its tokenizer, the limits, and the path from a request to
the engine and back."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lora_guard.engine.async_engine import AsyncEngine, EngineDeadError
from lora_guard.engine.llm_engine import RequestError, RequestOutput
from lora_guard.engine.lora.registry import valid_adapter_id
from lora_guard.engine.sampling import InvalidParams, SamplingParams
from lora_guard.server.errors import (
    APIError,
    generation,
    not_found,
    overloaded,
    unavailable,
    validation,
)


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

    @property
    def llm(self) -> Any:
        return self.engine.engine

    @property
    def tokenizer(self) -> Any:
        return self.engine.engine.tokenizer

    @property
    def model_id(self) -> str:
        return str(self.engine.engine.model_id)

    def check_adapter(self, adapter_id: str | None, *, openai: bool = False) -> str | None:
        """The adapter id a request names, validated; None for the base model."""
        if adapter_id is None or adapter_id in ("", "tgi", self.model_id):
            return None
        if not valid_adapter_id(adapter_id):
            raise validation(
                f"invalid adapter id {adapter_id!r}: use letters, digits, '-', '_' and '.'"
            )
        if not self.llm.adapters.knows(adapter_id):
            message = f"adapter {adapter_id!r} is not known"
            raise not_found(message) if openai else validation(message)
        return adapter_id

    def encode(self, text: str) -> list[int]:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise validation("`inputs` is not valid UTF-8 text (lone surrogate)") from None
        ids = self.llm.encode(text)
        if not ids:
            raise validation("`inputs` must not be empty")
        if len(ids) > self.limits.max_input_tokens:
            raise validation(
                f"`inputs` tokens must be <= {self.limits.max_input_tokens}. Given: {len(ids)}"
            )
        return list(ids)

    def sampling(
        self, prompt_len: int, max_new_tokens: int | None, **kwargs: Any
    ) -> SamplingParams:
        room = self.limits.max_total_tokens - prompt_len
        if room < 1:
            raise validation(
                f"`inputs` tokens + `max_new_tokens` must be <= {self.limits.max_total_tokens}. "
                f"Given: {prompt_len} `inputs` tokens and 1 `max_new_tokens`"
            )
        if max_new_tokens is None:
            max_new_tokens = room
        elif prompt_len + max_new_tokens > self.limits.max_total_tokens:
            raise validation(
                f"`inputs` tokens + `max_new_tokens` must be <= {self.limits.max_total_tokens}. "
                f"Given: {prompt_len} `inputs` tokens and {max_new_tokens} `max_new_tokens`"
            )
        stop = kwargs.get("stop") or []
        if len(stop) > self.limits.max_stop_sequences:
            raise validation(
                f"`stop` must have at most {self.limits.max_stop_sequences} items. "
                f"Given: {len(stop)}"
            )
        try:
            return SamplingParams(max_new_tokens=max_new_tokens, **kwargs)
        except InvalidParams as exc:
            raise validation(str(exc)) from None

    async def generate(
        self,
        prompt: list[int],
        params: SamplingParams,
        adapter_id: str | None,
        tenant_id: str,
    ) -> AsyncGenerator[RequestOutput, None]:
        """The engine's outputs for one request; failures become :class:`APIError`."""
        if not self.engine.is_alive:
            raise unavailable("the engine is not running")
        if self.in_flight >= self.limits.max_concurrent_requests:
            raise overloaded("Model is overloaded", 1.0)
        self.in_flight += 1
        try:
            stream = self.engine.generate(prompt, params, adapter_id, tenant_id=tenant_id)
            try:
                async for out in stream:
                    if out.error is not None:
                        if out.retry_after is not None:
                            raise overloaded(out.error, out.retry_after)
                        raise generation(out.error)
                    yield out
            except RequestError as exc:
                raise validation(str(exc)) from None
            except EngineDeadError as exc:
                raise APIError(500, str(exc), "incomplete_generation") from None
            finally:
                await stream.aclose()
        finally:
            self.in_flight -= 1


async def first_then_rest(
    outputs: AsyncGenerator[RequestOutput, None],
) -> tuple[RequestOutput, AsyncGenerator[RequestOutput, None]]:
    """Wait for the first output (so errors before it still get a status code), then the rest."""
    first = await outputs.__anext__()
    return first, outputs


async def final(outputs: AsyncGenerator[RequestOutput, None]) -> RequestOutput:
    """The finished output of a request, for the routes that answer in one piece."""
    last = None
    async for out in outputs:
        last = out
    assert last is not None, "the engine ends every request with a finished output"
    return last
