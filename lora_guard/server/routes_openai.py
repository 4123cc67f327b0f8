"""OpenAI's routes: /v1/chat/completions, /v1/completions, /v1/models. ``model`` names the
adapter; ``"tgi"`` or the base model id mean the base model."""

from __future__ import annotations

import logging
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from lora_guard.clock import wall
from lora_guard.engine.outputs import RequestOutput
from lora_guard.server.errors import validation
from lora_guard.server.pipeline import Ask, Run, sse, start
from lora_guard.server.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest
from lora_guard.server.state import ServerState, state_of

log = logging.getLogger(__name__)
router = APIRouter(prefix="/v1")
_IGNORED_SEEN: set[str] = set()  # fields logged once already
_IGNORED_LOGGED = 256  # at most this many names: a client cannot grow the set without bound
FINISH = {"eos_token": "stop", "stop_sequence": "stop", "length": "length"}


def _ask(body: ChatCompletionRequest | CompletionRequest, text: str) -> Ask:
    if body.n not in (None, 1):
        raise validation("`n` != 1 is not supported")
    _log_ignored(body)
    if body.top_k is not None and body.top_k < -1:
        raise validation("`top_k` must be strictly positive (-1 or 0: no top-k, as in vLLM)")
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    greedy = body.temperature is None or body.temperature == 0  # as in TGI
    max_tokens = body.max_tokens
    if isinstance(body, ChatCompletionRequest) and body.max_completion_tokens is not None:
        max_tokens = body.max_completion_tokens
    sampling = dict(
        do_sample=not greedy,
        temperature=None if greedy else body.temperature,
        top_p=None if greedy or body.top_p in (None, 1.0) else body.top_p,
        top_k=None if greedy or body.top_k in (None, -1, 0) else body.top_k,
        seed=body.seed,
        stop=stop,
        repetition_penalty=body.repetition_penalty,
        ignore_eos=body.ignore_eos,
        min_tokens=body.min_tokens,
        stop_token_ids=list(body.stop_token_ids or []),
        skip_special_tokens=body.skip_special_tokens,
    )
    return Ask(text, body.model, max_tokens, sampling, openai=True)


def _log_ignored(body: ChatCompletionRequest | CompletionRequest) -> None:
    """Name once, at debug level, each field a request sent that neither OpenAI's nor vLLM's
    parameters here use."""
    for name in (body.model_extra or {}).keys() - _IGNORED_SEEN:
        if len(_IGNORED_SEEN) >= _IGNORED_LOGGED:
            return
        _IGNORED_SEEN.add(name)
        log.debug("ignoring the OpenAI request field %r (not a parameter lora-guard has)", name)


def chat_text(
    state: ServerState, messages_in: list[ChatMessage], add_generation_prompt: bool = True
) -> str:
    """The prompt the model's chat template makes of ``messages_in`` (text parts only)."""
    if not messages_in:
        raise validation("`messages` must not be empty")
    messages = []
    for m in messages_in:
        content = m.content
        if isinstance(content, list):
            content = "".join(
                part.get("text", "") for part in content if part.get("type") == "text"
            )
        messages.append({"role": m.role, "content": content or ""})
    try:
        text: str = state.tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=False
        )
    except Exception as exc:
        raise validation(f"the chat template refused the messages: {exc}") from None
    return text


@dataclass(frozen=True, slots=True)
class _Reply:
    """The envelope every answer and chunk of one completion shares."""

    id: str
    model: str
    created: int = field(default_factory=lambda: int(wall()))

    def body(self, kind: str, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": kind,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": "lora-guard",
            "choices": [{"index": 0, **choice} for choice in choices],
            **extra,
        }


def _usage(run: Run, out: RequestOutput | None) -> dict[str, int]:
    """Prompt tokens (after the chat template) and tokens generated so far."""
    generated = len(out.token_ids) if out is not None else 0
    return {
        "prompt_tokens": len(run.prompt),
        "completion_tokens": generated,
        "total_tokens": len(run.prompt) + generated,
    }


@dataclass(frozen=True, slots=True)
class _StreamUsage:
    """What a stream tells of its token counts: nothing unless the client asks for it in
    ``stream_options`` (OpenAI's ``include_usage``: ``"usage": null`` on every chunk, then a
    last chunk with the counts and no choices; vLLM's ``continuous_usage_stats``: the counts so
    far on every chunk as well)."""

    include: bool = False
    continuous: bool = False

    @classmethod
    def of(cls, body: ChatCompletionRequest | CompletionRequest) -> _StreamUsage:
        options = body.stream_options
        if options is None:
            return cls()
        if not body.stream:
            raise validation("`stream_options` is only allowed when `stream` is true")
        return cls(options.include_usage, options.include_usage and options.continuous_usage_stats)

    def field(self, run: Run, out: RequestOutput | None) -> dict[str, Any]:
        if not self.include:
            return {}
        return {"usage": _usage(run, out) if self.continuous else None}


def _finish(out: RequestOutput) -> str | None:
    return FINISH.get(out.finish_reason or "")


@router.post("/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    state = state_of(request)
    reply = _Reply(f"chatcmpl-{uuid.uuid4().hex}", body.model or state.model_id)
    usage = _StreamUsage.of(body)
    run = await start(request, _ask(body, chat_text(state, body.messages)))
    if not body.stream:
        last = await run.final()
        message = {"role": "assistant", "content": last.text}
        choice = {"message": message, "logprobs": None, "finish_reason": _finish(last)}
        return JSONResponse(reply.body("chat.completion", [choice], usage=_usage(run, last)))

    def chunk(
        delta: dict[str, Any], out: RequestOutput | None, finish: str | None = None
    ) -> dict[str, Any]:
        choice = {"delta": delta, "logprobs": None, "finish_reason": finish}
        return reply.body("chat.completion.chunk", [choice], **usage.field(run, out))

    async def events() -> AsyncIterator[dict[str, Any]]:
        yield chunk({"role": "assistant", "content": ""}, None)
        async for text, out in _text_deltas(run):
            if text or not out.finished:
                yield chunk({"content": text}, out)
            if out.finished:
                yield chunk({}, out, _finish(out))
                if usage.include:
                    yield reply.body("chat.completion.chunk", [], usage=_usage(run, out))

    return sse(run, events(), openai=True)


@router.post("/completions")
async def completions(body: CompletionRequest, request: Request) -> Response:
    prompts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
    if len(prompts) != 1:
        raise validation("`prompt` must be one string")
    reply = _Reply(f"cmpl-{uuid.uuid4().hex}", body.model or state_of(request).model_id)
    usage = _StreamUsage.of(body)
    run = await start(request, _ask(body, prompts[0]))
    prefix = prompts[0] if body.echo else ""
    if not body.stream:
        last = await run.final()
        choice = {"text": prefix + last.text, "logprobs": None, "finish_reason": _finish(last)}
        return JSONResponse(reply.body("text_completion", [choice], usage=_usage(run, last)))

    def chunk(text: str, out: RequestOutput | None, finish: str | None = None) -> dict[str, Any]:
        choice = {"text": text, "logprobs": None, "finish_reason": finish}
        return reply.body("text_completion", [choice], **usage.field(run, out))

    async def events() -> AsyncIterator[dict[str, Any]]:
        if prefix:
            yield chunk(prefix, None)
        async for text, out in _text_deltas(run):
            if text or not out.finished:
                yield chunk(text, out)
            if out.finished:
                yield chunk("", out, _finish(out))
                if usage.include:
                    yield reply.body("text_completion", [], usage=_usage(run, out))

    return sse(run, events(), openai=True)


async def _text_deltas(run: Run) -> AsyncIterator[tuple[str, RequestOutput]]:
    """Each output that adds tokens, with the text it adds (empty while a character or a stop
    string is unfinished, or for a special token), and the last, finished one. A chunk for every
    new token, as vLLM streams, so a client's time to first token is the engine's."""
    sent, tokens = "", 0
    async for out in run.outputs():
        if len(out.token_ids) == tokens and not out.finished:
            continue
        tokens = len(out.token_ids)
        # Hold back a trailing replacement character: a multi-byte character is unfinished.
        ready = out.text if out.finished else out.text.rstrip("\ufffd")
        text = ""
        if len(ready) > len(sent) and ready.startswith(sent):
            text, sent = ready[len(sent) :], ready
        yield text, out


@router.get("/models")
async def models(request: Request) -> dict[str, Any]:
    state = state_of(request)
    created = int(wall())
    data = [{"id": state.model_id, "object": "model", "created": created, "owned_by": "lora-guard"}]
    for adapter_id in state.llm.adapter_ids():
        data.append(
            {
                "id": adapter_id,
                "object": "model",
                "created": created,
                "owned_by": "lora-guard",
                "parent": state.model_id,
            }
        )
    return {"object": "list", "data": data}
