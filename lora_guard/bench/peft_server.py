"""transformers + PEFT behind an OpenAI completions route: the server a team writes first, as the
capacity sweep's PEFT peer.

    python -m lora_guard.bench.peft_server --model DIR --adapter-dir DIR --adapters a,b --port P

Every adapter is loaded at start. One worker takes every request waiting (up to ``MAX_BATCH``)
and runs them as one mixed-adapter ``generate`` (``adapter_names``), streaming each request's
tokens as they come; the batch runs to its longest ``max_tokens``, and the next batch starts when
it returns (static batching: nothing joins a running batch).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

MAX_BATCH = 32
BASE_NAME = "base"
_BASE = "__base__"  # PEFT's name for "no adapter" in adapter_names


@dataclass
class _Ask:
    prompt: list[int]
    adapter: str | None
    max_tokens: int
    loop: asyncio.AbstractEventLoop
    out: asyncio.Queue[int | None] = field(default_factory=asyncio.Queue)
    error: str | None = None  # why its batch failed

    def put(self, token: int | None) -> None:
        self.loop.call_soon_threadsafe(self.out.put_nowait, token)


class _Streamer:
    """``generate``'s streamer: hands each step's new token to its request, up to its length."""

    def __init__(self, batch: list[_Ask]) -> None:
        self.batch = batch
        self.step = -1  # the first call carries the prompts

    def put(self, value: torch.Tensor) -> None:
        self.step += 1
        if self.step == 0:
            return
        for ask, token in zip(self.batch, value.reshape(-1).tolist(), strict=True):
            if self.step <= ask.max_tokens:
                ask.put(int(token))

    def end(self) -> None:
        pass


class PeftWorker:
    """The model, its adapters, and the thread that runs batches."""

    def __init__(self, model: str, adapter_dir: str, adapters: list[str], dtype: str) -> None:
        from peft import PeftModel
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model)
        base = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype))
        self.model: Any = base
        for i, name in enumerate(adapters):
            path = f"{adapter_dir}/{name}"
            if i == 0:
                self.model = PeftModel.from_pretrained(base, path, adapter_name=name)
            else:
                self.model.load_adapter(path, adapter_name=name)
        self.model.eval()
        self.adapters = set(adapters)
        self.pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.waiting: queue.Queue[_Ask] = queue.Queue()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while True:
            batch = [self.waiting.get()]
            while len(batch) < MAX_BATCH and not self.waiting.empty():
                batch.append(self.waiting.get_nowait())
            try:
                self._generate(batch)
            except Exception as exc:  # every request of the batch ends in the error
                print(f"batch failed: {exc}", flush=True)
                for ask in batch:
                    ask.error = f"{type(exc).__name__}: {exc}"
            for ask in batch:
                ask.put(None)

    def _generate(self, batch: list[_Ask]) -> None:
        width = max(len(a.prompt) for a in batch)
        ids = torch.tensor([[self.pad] * (width - len(a.prompt)) + a.prompt for a in batch])
        mask = torch.tensor([[0] * (width - len(a.prompt)) + [1] * len(a.prompt) for a in batch])
        new = max(a.max_tokens for a in batch)
        with torch.no_grad():
            self.model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=self.pad,
                streamer=_Streamer(batch),
                adapter_names=[a.adapter or _BASE for a in batch],
            )


def build_app(worker: PeftWorker) -> Any:
    from lora_guard.engine.tokens import encode_text

    app = FastAPI()

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        body = await request.json()
        model = body.get("model") or BASE_NAME
        if model != BASE_NAME and model not in worker.adapters:
            return JSONResponse({"error": {"message": f"unknown model {model!r}"}}, 404)
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            return JSONResponse({"error": {"message": "`prompt` must be one string"}}, 400)
        ask = _Ask(
            encode_text(worker.tokenizer, prompt),
            None if model == BASE_NAME else model,
            int(body.get("max_tokens") or 16),
            asyncio.get_running_loop(),
        )
        worker.waiting.put(ask)
        if body.get("stream"):
            return StreamingResponse(_chunks(ask, model, worker), media_type="text/event-stream")
        tokens = [t async for t in _tokens(ask)]
        if ask.error is not None:
            return JSONResponse({"error": {"message": ask.error}}, 500)
        return {
            "object": "text_completion",
            "model": model,
            "choices": [
                {"index": 0, "text": worker.tokenizer.decode(tokens), "finish_reason": "length"}
            ],
            "usage": _usage(ask, len(tokens)),
        }

    return app


async def _tokens(ask: _Ask) -> AsyncIterator[int]:
    while (token := await ask.out.get()) is not None:
        yield token


async def _chunks(ask: _Ask, model: str, worker: PeftWorker) -> AsyncIterator[str]:
    ident = f"cmpl-{uuid.uuid4().hex}"
    head = {"id": ident, "object": "text_completion", "created": int(time.time()), "model": model}
    count = 0
    async for token in _tokens(ask):
        count += 1
        text = worker.tokenizer.decode([token])
        choice = {"index": 0, "text": text, "token_ids": [token], "finish_reason": None}
        yield f"data: {json.dumps(head | {'choices': [choice]})}\n\n"
    if ask.error is not None:
        yield f"data: {json.dumps({'error': {'message': ask.error}})}\n\n"
        return
    yield f"data: {json.dumps(head | {'choices': [], 'usage': _usage(ask, count)})}\n\n"
    yield "data: [DONE]\n\n"


def _usage(ask: _Ask, generated: int) -> dict[str, int]:
    prompt = len(ask.prompt)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": generated,
        "total_tokens": prompt + generated,
    }


def main() -> None:
    import uvicorn

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--adapter-dir", required=True)
    parser.add_argument("--adapters", default="", help="comma-separated adapter folder names")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8702)
    args = parser.parse_args()
    adapters = [a for a in args.adapters.split(",") if a]
    worker = PeftWorker(args.model, args.adapter_dir, adapters, args.dtype)
    uvicorn.run(build_app(worker), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
