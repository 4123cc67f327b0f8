"""transformers + PEFT behind an OpenAI completions route, batched continuously: the capacity
sweep's PEFT peer, as strong as transformers and PEFT make it without an engine of their own.

    python -m lora_guard.bench.peft_server --model DIR --adapter-dir DIR --adapters a,b --port P

Every adapter is loaded at start, in the model's dtype (PEFT would otherwise keep float16 and
bfloat16 adapters in float32). transformers' own continuous batching takes no adapter per
request, so one worker thread batches at the iteration level itself: each step, requests that
arrived are prefilled together (left-padded, each row with its adapter through PEFT's
``adapter_names``) and join the running batch; then every running request decodes one token in
one mixed-adapter forward; a request leaves the batch at its last token and its KV rows with it.
Up to ``MAX_BATCH`` requests run at once; tokens stream as they come. What it lacks beside a
serving engine: a prefix cache (every prompt is prefilled whole) and paged KV (the batch's KV is
one padded tensor a layer, copied as requests join and leave).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import queue
import threading
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from lora_guard.clock import wall

MAX_BATCH = 64
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
    sent: int = 0  # tokens generated so far

    def put(self, token: int | None) -> None:
        self.loop.call_soon_threadsafe(self.out.put_nowait, token)


class Batch:
    """The running requests, their KV (one left-padded tensor a layer), the mask of the real
    positions in it, and each row's last token and length."""

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        self.asks: list[_Ask] = []
        self.cache: Any = None  # transformers' DynamicCache, rows in the order of ``asks``
        self.mask = torch.zeros(0, 0, dtype=torch.long)
        self.last = torch.zeros(0, 1, dtype=torch.long)
        self.lengths = torch.zeros(0, 1, dtype=torch.long)

    def join(self, asks: list[_Ask], cache: Any, mask: torch.Tensor, first: torch.Tensor) -> None:
        """Add prefilled ``asks`` (their cache, mask and first tokens) to the batch."""
        lengths = mask.sum(-1, keepdim=True)
        if self.cache is None:
            self.asks, self.cache, self.mask = list(asks), cache, mask
            self.last, self.lengths = first, lengths
            return
        width = max(self.mask.shape[1], mask.shape[1])
        for mine, theirs in zip(self.cache.layers, cache.layers, strict=True):
            mine.keys = torch.cat([_left_pad(mine.keys, width), _left_pad(theirs.keys, width)])
            mine.values = torch.cat(
                [_left_pad(mine.values, width), _left_pad(theirs.values, width)]
            )
        self.mask = torch.cat([_left_pad_mask(self.mask, width), _left_pad_mask(mask, width)])
        self.asks += asks
        self.last = torch.cat([self.last, first])
        self.lengths = torch.cat([self.lengths, lengths])

    def keep(self, rows: list[int]) -> None:
        """Keep only ``rows``; drop the columns no row uses any more."""
        if not rows:
            self.clear()
            return
        index = torch.tensor(rows)
        self.cache.batch_select_indices(index)
        self.asks = [self.asks[i] for i in rows]
        self.mask, self.last, self.lengths = self.mask[index], self.last[index], self.lengths[index]
        unused = int((self.mask.sum(0) == 0).long().cumprod(0).sum())  # leading empty columns
        if unused:
            self.mask = self.mask[:, unused:]
            for layer in self.cache.layers:
                layer.keys, layer.values = layer.keys[:, :, unused:], layer.values[:, :, unused:]


def _left_pad(t: torch.Tensor, width: int) -> torch.Tensor:
    return F.pad(t, (0, 0, width - t.shape[-2], 0))


def _left_pad_mask(mask: torch.Tensor, width: int) -> torch.Tensor:
    return F.pad(mask, (width - mask.shape[1], 0))


class PeftWorker:
    """The model, its adapters, and the thread that steps the batch."""

    def __init__(self, model: str, adapter_dir: str, adapters: list[str], dtype: str) -> None:
        from peft import PeftModel
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model)
        base = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype))
        self.model: Any = base
        for i, name in enumerate(adapters):
            path = f"{adapter_dir}/{name}"
            if i == 0:
                self.model = PeftModel.from_pretrained(
                    base, path, adapter_name=name, autocast_adapter_dtype=False
                )
            else:
                self.model.load_adapter(path, adapter_name=name, autocast_adapter_dtype=False)
        self.model.eval()
        self.adapters = set(adapters)
        self.pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.waiting: queue.Queue[_Ask] = queue.Queue()
        self.batch = Batch()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while True:
            # an idle worker sleeps until a request comes
            arrived = [] if self.batch.asks else [self.waiting.get()]
            while len(self.batch.asks) + len(arrived) < MAX_BATCH and not self.waiting.empty():
                arrived.append(self.waiting.get_nowait())
            try:
                with torch.no_grad():
                    if arrived:
                        self._prefill(arrived)
                    self._decode()
            except Exception as exc:  # every running request ends in the error
                print(f"step failed: {exc}", flush=True)
                running = {id(a): a for a in [*self.batch.asks, *arrived]}
                for ask in running.values():
                    if ask.sent < ask.max_tokens:
                        ask.error = f"{type(exc).__name__}: {exc}"
                        ask.put(None)
                self.batch.clear()

    def _names(self, asks: list[_Ask]) -> list[str]:
        return [a.adapter or _BASE for a in asks]

    def _prefill(self, asks: list[_Ask]) -> None:
        """Prefill ``asks`` together; each gets its first token, and those asking for more join
        the batch."""
        from transformers import DynamicCache

        width = max(len(a.prompt) for a in asks)
        ids = torch.tensor([[self.pad] * (width - len(a.prompt)) + a.prompt for a in asks])
        mask = torch.tensor([[0] * (width - len(a.prompt)) + [1] * len(a.prompt) for a in asks])
        out = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
            past_key_values=DynamicCache(),
            use_cache=True,
            adapter_names=self._names(asks),
        )
        first = out.logits[:, -1].argmax(-1, keepdim=True)
        self.batch.join(asks, out.past_key_values, mask, first)
        self._emit(first.reshape(-1).tolist(), start=len(self.batch.asks) - len(asks))

    def _decode(self) -> None:
        """One token for every running request, in one forward."""
        batch = self.batch
        if not batch.asks:
            return
        mask = F.pad(batch.mask, (0, 1), value=1)
        out = self.model(
            input_ids=batch.last,
            attention_mask=mask,
            position_ids=batch.lengths,
            past_key_values=batch.cache,
            use_cache=True,
            adapter_names=self._names(batch.asks),
        )
        batch.cache, batch.mask = out.past_key_values, mask
        batch.last = out.logits[:, -1].argmax(-1, keepdim=True)
        batch.lengths = batch.lengths + 1
        self._emit(batch.last.reshape(-1).tolist(), start=0)

    def _emit(self, tokens: list[int], start: int) -> None:
        """Hand rows ``start``.. their new tokens; requests that have all theirs leave."""
        batch = self.batch
        for ask, token in zip(batch.asks[start:], tokens, strict=True):
            ask.sent += 1
            ask.put(token)
            if ask.sent >= ask.max_tokens:
                ask.put(None)
        running = [i for i, a in enumerate(batch.asks) if a.sent < a.max_tokens]
        if len(running) < len(batch.asks):  # only then is the KV copied
            batch.keep(running)


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
        max_tokens = body.get("max_tokens", 16)
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            return JSONResponse({"error": {"message": "`max_tokens` must be an integer >= 1"}}, 400)
        ids = encode_text(worker.tokenizer, prompt)
        if not ids:
            return JSONResponse({"error": {"message": "`prompt` has no tokens"}}, 400)
        ask = _Ask(
            ids,
            None if model == BASE_NAME else model,
            max_tokens,
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
    head = {"id": ident, "object": "text_completion", "created": int(wall()), "model": model}
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
