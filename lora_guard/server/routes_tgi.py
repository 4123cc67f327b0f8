"""TGI's routes: /generate, /generate_stream, / (compat), /info, /health, /metrics (``/tokenize``
is in ``routes_tokens``, beside vLLM's)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from lora_guard import __version__
from lora_guard.engine.outputs import RequestOutput
from lora_guard.server.auth import require_admin
from lora_guard.server.errors import unavailable, validation
from lora_guard.server.pipeline import Ask, sse, start
from lora_guard.server.protocol import CompatGenerateRequest, GenerateRequest
from lora_guard.server.state import ServerState, state_of

router = APIRouter()
#: TGI's parameters that are the engine's sampling parameters of the same name
_SAMPLING = {"do_sample", "temperature", "top_k", "top_p", "seed", "repetition_penalty", "stop"}


def _ask(body: GenerateRequest) -> Ask:
    p = body.parameters
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
    sampling = p.model_dump(include=_SAMPLING)
    return Ask(body.inputs, p.adapter_id, p.max_new_tokens, sampling, truncate=p.truncate)


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


def _text(body: GenerateRequest, out: RequestOutput) -> str:
    return body.inputs + out.text if body.parameters.return_full_text else out.text


async def _generate(body: GenerateRequest, request: Request) -> dict[str, Any]:
    run = await start(request, _ask(body))
    last = await run.final()
    result: dict[str, Any] = {"generated_text": _text(body, last)}
    if body.parameters.details:
        result["details"] = {
            "finish_reason": last.finish_reason,
            "generated_tokens": len(last.token_ids),
            "seed": run.params.seed,
            "prefill": [],
            "tokens": _tokens(state_of(request), last),
        }
    return result


async def _stream(body: GenerateRequest, request: Request) -> Response:
    state = state_of(request)
    run = await start(request, _ask(body))

    async def events() -> AsyncIterator[dict[str, Any]]:
        sent, index = 0, 0
        async for out in run.outputs():
            for token in _tokens(state, out, sent):
                index += 1
                event: dict[str, Any] = {
                    "index": index,
                    "token": token,
                    "top_tokens": [],
                    "generated_text": None,
                    "details": None,
                }
                if out.finished and index == len(out.token_ids):
                    event["generated_text"] = _text(body, out)
                    event["details"] = {
                        "finish_reason": out.finish_reason,
                        "generated_tokens": len(out.token_ids),
                        "input_length": len(run.prompt),
                        "seed": run.params.seed,
                    }
                yield event
            sent = len(out.token_ids)

    return sse(run, events(), openai=False)


@router.post("/generate")
async def generate(body: GenerateRequest, request: Request) -> JSONResponse:
    return JSONResponse(await _generate(body, request))


@router.post("/generate_stream")
async def generate_stream(body: GenerateRequest, request: Request) -> Response:
    return await _stream(body, request)


@router.post("/")
async def compat_generate(body: CompatGenerateRequest, request: Request) -> Response:
    if body.stream:
        return await _stream(body, request)
    return JSONResponse([await _generate(body, request)])


@router.get("/info")
async def info(request: Request) -> dict[str, Any]:
    state = state_of(request)
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
    state = state_of(request)
    if not (state.ready and state.engine.is_alive):
        raise unavailable("the engine is not ready")
    return Response(status_code=200)


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    state = state_of(request)
    require_admin(state.keys, getattr(request.state, "api_key", None), "/metrics")
    plugin = state.metrics
    if plugin is None:
        return Response("", media_type="text/plain")
    return Response(plugin.render(), media_type=plugin.content_type)
