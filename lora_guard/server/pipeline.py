"""The one path of a generation request, for the TGI and the OpenAI routes alike.

The route parses its body into an :class:`Ask`; :func:`start` then resolves the adapter's name,
authorizes the caller, finds its tenant, applies the limits and submits the request to the
engine, which alone decides whether the adapter exists. :func:`sse` writes every stream.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from lora_guard.engine.outputs import RequestOutput
from lora_guard.engine.sampling import InvalidParams, SamplingParams
from lora_guard.naming import adapter_of
from lora_guard.server.errors import APIError, validation
from lora_guard.server.state import ServerState, state_of
from lora_guard.tenancy import header_tenant


@dataclass(frozen=True, slots=True)
class Ask:
    """A generation request as a route parsed it, in TGI's terms."""

    text: str
    adapter: str | None  # as the client named it (lora_guard.naming: which names mean the base)
    max_new_tokens: int | None
    sampling: dict[str, Any] = field(default_factory=dict)  # SamplingParams' other fields
    truncate: int | None = None
    openai: bool = False  # answer as the OpenAI routes do (an unknown adapter is a 404)


@dataclass(slots=True)
class Run:
    """A request the engine took: its prompt, its parameters and its outputs, the first in hand
    (so that errors before it still get their status code)."""

    prompt: list[int]
    params: SamplingParams
    first: RequestOutput
    rest: AsyncGenerator[RequestOutput, None]
    last: RequestOutput | None = None  # the latest output read (the request log's)

    async def outputs(self) -> AsyncIterator[RequestOutput]:
        """Every output, the first included; the last one is finished."""
        self.last = self.first
        yield self.first
        async for out in self.rest:
            self.last = out
            yield out

    async def final(self) -> RequestOutput:
        self.last = self.first
        async for out in self.rest:
            self.last = out
        return self.last


async def start(request: Request, ask: Ask) -> Run:
    """Hand ``ask`` to the engine, or raise the :class:`APIError` that refuses it."""
    state = state_of(request)
    adapter_id = adapter_of(ask.adapter, state.model_id)
    _authorize(request, adapter_id)
    tenant = _tenant(request)
    prompt = _encode(state, ask.text)
    if ask.truncate is not None and 0 < ask.truncate < len(prompt):
        prompt = prompt[-ask.truncate :]
    params = _sampling(state, len(prompt), ask.max_new_tokens, ask.sampling)
    arrival = getattr(request.state, "arrival", None)
    outputs = state.generate(prompt, params, adapter_id, tenant, openai=ask.openai, arrival=arrival)
    run = Run(prompt, params, await outputs.__anext__(), outputs)
    request.state.run = run  # the server's door logs its times once the answer is written
    return run


def sse(run: Run, events: AsyncIterator[dict[str, Any]], *, openai: bool) -> StreamingResponse:
    """The one SSE writer: each event as ``data:`` JSON (OpenAI's ``data: `` and a closing
    ``[DONE]``); an error after the 200 goes out as the next event, with its JSON body."""
    prefix = b"data: " if openai else b"data:"

    def line(body: object) -> bytes:
        return prefix + json.dumps(body).encode() + b"\n\n"

    async def body() -> AsyncIterator[bytes]:
        try:
            async for event in events:
                yield line(event)
        except APIError as exc:
            yield line(exc.body())
        finally:
            await run.rest.aclose()  # a client gone: the request is aborted
        if openai:
            yield prefix + b"[DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream")


def _tenant(request: Request) -> str:
    """The caller's tenant: its API key's when keys are configured (no header overrides a key),
    else X-Tenant-Id, else the gateway's fairness id, else ``default``."""
    key = getattr(request.state, "api_key", None)
    if key is not None:
        return str(key.tenant)
    return header_tenant(request.headers) or "default"


def _authorize(request: Request, adapter_id: str | None) -> None:
    key = getattr(request.state, "api_key", None)
    if key is not None and not key.may_use(adapter_id):
        raise APIError(403, f"this API key may not use adapter {adapter_id!r}", "forbidden")


def _encode(state: ServerState, text: str) -> list[int]:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise validation("`inputs` is not valid UTF-8 text (lone surrogate)") from None
    ids = state.llm.encode(text)
    if not ids:
        raise validation("`inputs` must not be empty")
    limit = state.limits.max_input_tokens
    if len(ids) > limit:
        raise validation(f"`inputs` tokens must be <= {limit}. Given: {len(ids)}")
    return list(ids)


def _sampling(
    state: ServerState, prompt_len: int, max_new_tokens: int | None, sampling: dict[str, Any]
) -> SamplingParams:
    total = state.limits.max_total_tokens
    room = total - prompt_len
    if room < 1:
        raise validation(
            f"`inputs` tokens + `max_new_tokens` must be <= {total}. "
            f"Given: {prompt_len} `inputs` tokens and 1 `max_new_tokens`"
        )
    if max_new_tokens is None:
        max_new_tokens = room
    elif prompt_len + max_new_tokens > total:
        raise validation(
            f"`inputs` tokens + `max_new_tokens` must be <= {total}. "
            f"Given: {prompt_len} `inputs` tokens and {max_new_tokens} `max_new_tokens`"
        )
    stop = sampling.get("stop") or []
    if len(stop) > state.limits.max_stop_sequences:
        raise validation(
            f"`stop` must have at most {state.limits.max_stop_sequences} items. Given: {len(stop)}"
        )
    try:
        return SamplingParams(max_new_tokens=max_new_tokens, **sampling)
    except InvalidParams as exc:
        raise validation(str(exc)) from None
