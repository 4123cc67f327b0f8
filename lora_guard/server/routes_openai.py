"""OpenAI's routes: /v1/chat/completions, /v1/completions, /v1/models. ``model`` names the
adapter; ``"tgi"`` or the base model id mean the base model."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from lora_guard.engine.llm_engine import RequestOutput
from lora_guard.server.errors import APIError, validation
from lora_guard.server.protocol import ChatCompletionRequest, CompletionRequest
from lora_guard.server.routes_tgi import _authorize, _state, _tenant
from lora_guard.server.state import ServerState, final, first_then_rest

router = APIRouter(prefix="/v1")
FINISH = {"eos_token": "stop", "stop_sequence": "stop", "length": "length"}


def _params(
    state: ServerState, body: ChatCompletionRequest | CompletionRequest, prompt: list[int]
) -> Any:
    if body.n not in (None, 1):
        raise validation("`n` != 1 is not supported")
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    greedy = body.temperature is None or body.temperature == 0  # as in TGI
    max_tokens = body.max_tokens
    if isinstance(body, ChatCompletionRequest) and body.max_completion_tokens is not None:
        max_tokens = body.max_completion_tokens
    return state.sampling(
        len(prompt), max_tokens, do_sample=not greedy,
        temperature=None if greedy else body.temperature,
        top_p=None if greedy or body.top_p in (None, 1.0) else body.top_p,
        seed=body.seed, stop=stop,
    )  # fmt: skip


def _chat_prompt(state: ServerState, body: ChatCompletionRequest) -> list[int]:
    if not body.messages:
        raise validation("`messages` must not be empty")
    messages = []
    for m in body.messages:
        content = m.content
        if isinstance(content, list):
            content = "".join(
                part.get("text", "") for part in content if part.get("type") == "text"
            )
        messages.append({"role": m.role, "content": content or ""})
    try:
        text = state.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False
        )
    except Exception as exc:
        raise validation(f"the chat template refused the messages: {exc}") from None
    return state.encode(text)


def _usage(prompt: list[int], out: RequestOutput) -> dict[str, int]:
    return {
        "prompt_tokens": len(prompt),
        "completion_tokens": len(out.token_ids),
        "total_tokens": len(prompt) + len(out.token_ids),
    }


@router.post("/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    state = _state(request)
    adapter = state.check_adapter(body.model, openai=True)
    _authorize(request, adapter)
    prompt = _chat_prompt(state, body)
    params = _params(state, body, prompt)
    model = body.model or state.model_id
    cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    outputs = state.generate(prompt, params, adapter, _tenant(request))
    if not body.stream:
        last = await final(outputs)
        return JSONResponse({
            "id": cid, "object": "chat.completion", "created": created, "model": model,
            "system_fingerprint": "lora-guard",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": last.text},
                         "logprobs": None, "finish_reason": FINISH.get(last.finish_reason or "")}],
            "usage": _usage(prompt, last),
        })  # fmt: skip

    def chunk(
        delta: dict[str, Any], finish: str | None, usage: dict[str, int] | None = None
    ) -> bytes:
        body_ = {
            "id": cid,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
            "system_fingerprint": "lora-guard",
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
        }
        if usage is not None:
            body_["usage"] = usage
        return b"data: " + json.dumps(body_).encode() + b"\n\n"

    first, rest = await first_then_rest(outputs)

    async def events() -> AsyncIterator[bytes]:
        yield chunk({"role": "assistant", "content": ""}, None)
        try:
            async for piece in _text_deltas(first, rest):
                if isinstance(piece, str):
                    yield chunk({"content": piece}, None)
                else:
                    yield chunk({}, FINISH.get(piece.finish_reason or ""), _usage(prompt, piece))
        except _StreamError as exc:
            yield b"data: " + json.dumps(exc.error.body()).encode() + b"\n\n"
        yield b"data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


@router.post("/completions")
async def completions(body: CompletionRequest, request: Request) -> Response:
    state = _state(request)
    adapter = state.check_adapter(body.model, openai=True)
    _authorize(request, adapter)
    prompts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
    if len(prompts) != 1:
        raise validation("`prompt` must be one string")
    prompt = state.encode(prompts[0])
    params = _params(state, body, prompt)
    model = body.model or state.model_id
    cid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
    outputs = state.generate(prompt, params, adapter, _tenant(request))
    prefix = prompts[0] if body.echo else ""
    if not body.stream:
        last = await final(outputs)
        return JSONResponse({
            "id": cid, "object": "text_completion", "created": created, "model": model,
            "system_fingerprint": "lora-guard",
            "choices": [{"index": 0, "text": prefix + last.text, "logprobs": None,
                         "finish_reason": FINISH.get(last.finish_reason or "")}],
            "usage": _usage(prompt, last),
        })  # fmt: skip

    def chunk(text: str, finish: str | None) -> bytes:
        body_ = {
            "id": cid,
            "object": "text_completion",
            "created": created,
            "model": model,
            "system_fingerprint": "lora-guard",
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}],
        }
        return b"data: " + json.dumps(body_).encode() + b"\n\n"

    first, rest = await first_then_rest(outputs)

    async def events() -> AsyncIterator[bytes]:
        if prefix:
            yield chunk(prefix, None)
        try:
            async for piece in _text_deltas(first, rest):
                if isinstance(piece, str):
                    yield chunk(piece, None)
                else:
                    yield chunk("", FINISH.get(piece.finish_reason or ""))
        except _StreamError as exc:
            yield b"data: " + json.dumps(exc.error.body()).encode() + b"\n\n"
        yield b"data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


async def _text_deltas(
    first: RequestOutput, rest: AsyncGenerator[RequestOutput, None]
) -> AsyncGenerator[str | RequestOutput, None]:
    """New text after each step, then the final output; an error mid-stream as a last event."""
    sent, out = "", first
    try:
        while True:
            text = out.text
            # Hold back a trailing replacement character: a multi-byte character is unfinished.
            ready = text if out.finished else text.rstrip("\ufffd")
            if len(ready) > len(sent) and ready.startswith(sent):
                yield ready[len(sent) :]
                sent = ready
            if out.finished:
                yield out
                return
            out = await rest.__anext__()
    except APIError as exc:
        raise _StreamError(exc) from None
    finally:
        await rest.aclose()


class _StreamError(Exception):
    def __init__(self, error: APIError) -> None:
        super().__init__(error.error)
        self.error = error


@router.get("/models")
async def models(request: Request) -> dict[str, Any]:
    state = _state(request)
    created = int(time.time())
    data = [{"id": state.model_id, "object": "model", "created": created, "owned_by": "lora-guard"}]
    for adapter_id in sorted(state.llm.adapters.registry.entries):
        data.append({"id": adapter_id, "object": "model", "created": created,
                     "owned_by": "lora-guard", "parent": state.model_id})  # fmt: skip
    return {"object": "list", "data": data}
