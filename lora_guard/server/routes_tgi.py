"""TGI's routes: /generate, /generate_stream, / (compat), /info, /health, /metrics, /tokenize."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from lora_guard import __version__
from lora_guard.engine.llm_engine import RequestOutput
from lora_guard.server.auth import require_admin
from lora_guard.server.errors import APIError, unavailable, validation
from lora_guard.server.protocol import (
    CompatGenerateRequest,
    GenerateParameters,
    GenerateRequest,
    TokenizeRequest,
)
from lora_guard.server.state import ServerState, final, first_then_rest

router = APIRouter()


def _state(request: Request) -> ServerState:
    state: ServerState = request.app.state.lora_guard
    return state


def _tenant(request: Request) -> str:
    """The caller's tenant: from its API key when keys are configured, else X-Tenant-Id."""
    key = getattr(request.state, "api_key", None)
    if key is not None:
        return str(key.tenant)
    return request.headers.get("x-tenant-id") or "default"


def _authorize(request: Request, adapter_id: str | None) -> None:
    key = getattr(request.state, "api_key", None)
    if key is not None and not key.may_use(adapter_id):
        raise APIError(403, f"this API key may not use adapter {adapter_id!r}", "forbidden")


def _unsupported(p: GenerateParameters) -> None:
    if p.best_of not in (None, 1):
        raise validation("`best_of` != 1 is not supported")
    if p.top_n_tokens:
        raise validation("`top_n_tokens` is not supported")
    if p.grammar is not None:
        raise validation("`grammar` is not supported")
    if p.typical_p is not None and not p.typical_p >= 1:  # NaN included
        raise validation("`typical_p` is not supported")
    if p.frequency_penalty:
        raise validation("`frequency_penalty` is not supported")
    if p.watermark:
        raise validation("`watermark` is not supported")
    if p.seed is not None and p.seed < 0:
        raise validation("`seed` must be a non-negative integer")


def _prepare(
    state: ServerState, body: GenerateRequest, request: Request
) -> tuple[list[int], Any, str | None]:
    p = body.parameters
    _unsupported(p)
    adapter = state.check_adapter(p.adapter_id)
    _authorize(request, adapter)
    prompt = state.encode(body.inputs)
    if p.truncate is not None and 0 < p.truncate < len(prompt):
        prompt = prompt[-p.truncate :]
    params = state.sampling(
        len(prompt), p.max_new_tokens, do_sample=p.do_sample, temperature=p.temperature,
        top_k=p.top_k, top_p=p.top_p, seed=p.seed, repetition_penalty=p.repetition_penalty,
        stop=list(p.stop),
    )  # fmt: skip
    return prompt, params, adapter


def _tokens(state: ServerState, out: RequestOutput, start: int = 0) -> list[dict[str, Any]]:
    special = set(state.tokenizer.all_special_ids)
    return [
        {
            "id": t,
            "text": state.tokenizer.decode([t], skip_special_tokens=False),
            "logprob": out.logprobs[i],
            "special": t in special,
        }
        for i, t in enumerate(out.token_ids[start:], start)
    ]


def _details(state: ServerState, out: RequestOutput, seed: int | None) -> dict[str, Any]:
    return {
        "finish_reason": out.finish_reason,
        "generated_tokens": len(out.token_ids),
        "seed": seed,
        "prefill": [],
        "tokens": _tokens(state, out),
    }


async def _generate(state: ServerState, body: GenerateRequest, request: Request) -> dict[str, Any]:
    prompt, params, adapter = _prepare(state, body, request)
    last = await final(state.generate(prompt, params, adapter, _tenant(request)))
    text = last.text
    if body.parameters.return_full_text:
        text = body.inputs + text
    result: dict[str, Any] = {"generated_text": text}
    if body.parameters.details:
        result["details"] = _details(state, last, params.seed)
    return result


async def _stream(state: ServerState, body: GenerateRequest, request: Request) -> Response:
    prompt, params, adapter = _prepare(state, body, request)
    outputs = state.generate(prompt, params, adapter, _tenant(request))
    first, rest = await first_then_rest(outputs)  # errors so far still get their status code

    async def events() -> AsyncIterator[bytes]:
        sent, index, out = 0, 0, first
        try:
            while True:
                for token in _tokens(state, out, sent):
                    index += 1
                    event: dict[str, Any] = {"index": index, "token": token, "top_tokens": [],
                                             "generated_text": None, "details": None}  # fmt: skip
                    if out.finished and index == len(out.token_ids):
                        text = out.text
                        if body.parameters.return_full_text:
                            text = body.inputs + text
                        event["generated_text"] = text
                        event["details"] = {
                            "finish_reason": out.finish_reason,
                            "generated_tokens": len(out.token_ids),
                            "input_length": len(prompt),
                            "seed": params.seed,
                        }
                    yield b"data:" + json.dumps(event).encode() + b"\n\n"
                sent = len(out.token_ids)
                if out.finished:
                    return
                out = await rest.__anext__()
        except APIError as exc:
            yield b"data:" + json.dumps(exc.body()).encode() + b"\n\n"
        except StopAsyncIteration:
            return
        finally:
            await rest.aclose()

    return StreamingResponse(events(), media_type="text/event-stream")


@router.post("/generate")
async def generate(body: GenerateRequest, request: Request) -> JSONResponse:
    return JSONResponse(await _generate(_state(request), body, request))


@router.post("/generate_stream")
async def generate_stream(body: GenerateRequest, request: Request) -> Response:
    return await _stream(_state(request), body, request)


@router.post("/")
async def compat_generate(body: CompatGenerateRequest, request: Request) -> Response:
    if body.stream:
        return await _stream(_state(request), body, request)
    return JSONResponse([await _generate(_state(request), body, request)])


@router.get("/info")
async def info(request: Request) -> dict[str, Any]:
    state = _state(request)
    llm = state.llm
    return {
        "model_id": state.model_id,
        "model_sha": None,
        "model_pipeline_tag": "text-generation",
        "model_dtype": str(llm.config.torch_dtype).removeprefix("torch."),
        "model_device_type": llm.config.torch_device.type,
        "max_concurrent_requests": state.limits.max_concurrent_requests,
        "max_best_of": 1,
        "max_stop_sequences": state.limits.max_stop_sequences,
        "max_input_tokens": state.limits.max_input_tokens,
        "max_total_tokens": state.limits.max_total_tokens,
        "validation_workers": 1,
        "max_client_batch_size": 1,
        "router": "lora-guard",
        "version": __version__,
        "sha": None,
        "docker_label": None,
    }


@router.get("/health")
async def health(request: Request) -> Response:
    state = _state(request)
    if not (state.ready and state.engine.is_alive):
        raise unavailable("the engine is not ready")
    return Response(status_code=200)


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    state = _state(request)
    require_admin(state.keys, getattr(request.state, "api_key", None), "/metrics")
    plugin = state.metrics
    if plugin is None:
        return Response("", media_type="text/plain")
    return Response(plugin.render(), media_type=plugin.content_type)


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request) -> list[dict[str, Any]]:
    state = _state(request)
    encoding = state.tokenizer(body.inputs, return_offsets_mapping=True, add_special_tokens=False)
    return [
        {"id": i, "text": body.inputs[a:b], "start": a, "stop": b}
        for i, (a, b) in zip(encoding["input_ids"], encoding["offset_mapping"], strict=True)
    ]
