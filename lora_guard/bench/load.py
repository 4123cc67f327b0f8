"""Load on a server's OpenAI completions route: a closed loop of N clients, or arrivals at the
trace's times (open loop). The same client for every system in a capacity sweep.

Each request is streamed (``stream_options.include_usage``) with the trace's prompt as text,
``max_tokens`` = its ``max_new_tokens``, greedy, ``ignore_eos`` (every system generates exactly
what was asked), ``model`` = the system's name for the adapter. What comes back is timed per chunk,
so a closed loop's throughput is read while all N clients are busy, not while the last few drain.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx

from lora_guard.clock import monotonic
from lora_guard.demo import testing
from lora_guard.workload.trace import TraceRequest

_TIMEOUT_S = 900.0
_STALE_RETRIES = 2

# What a system adds to a request's body (its adapter's name, or a per-request LoRA list).
Body = Callable[[TraceRequest], dict[str, Any]]


@dataclass
class Reply:
    """One request as its client saw it; times in seconds from the start of the load."""

    id: str
    sent: float
    first_token: float | None = None
    finish: float | None = None
    tokens: int = 0  # the server's count (usage), else the chunks
    chunks: list[float] = field(default_factory=list)  # when each chunk with a choice came
    error: str | None = None
    retries: int = 0  # sent again after a stale kept-alive connection

    def tokens_by(self, moment: float) -> float:
        """Tokens out by ``moment``: the count spread evenly over the chunks (servers differ in
        what a chunk holds: a token, a token with no text yet, the finish)."""
        if not self.chunks:
            return 0.0
        return self.tokens * sum(1 for t in self.chunks if t <= moment) / len(self.chunks)


def closed_loop(url: str, trace: list[TraceRequest], clients: int, body: Body) -> list[Reply]:
    """``clients`` clients, each sending the trace's next request as soon as its last one ended."""
    start = monotonic()
    return testing.closed_loop(
        url, trace, lambda http, r: _send(http, r, body, start), clients, timeout_s=_TIMEOUT_S
    )


def open_loop(url: str, trace: list[TraceRequest], body: Body) -> list[Reply]:
    """Each request sent at its trace time, whatever is still running."""
    replies: list[Reply] = []
    start = monotonic()

    def sender(request: TraceRequest) -> Callable[[httpx.Client], None]:
        def send(http: httpx.Client) -> None:
            time.sleep(max(0.0, request.time - (monotonic() - start)))
            replies.append(_send(http, request, body, start))

        return send

    limits = httpx.Limits(max_connections=len(trace), max_keepalive_connections=len(trace))
    with httpx.Client(base_url=url, timeout=_TIMEOUT_S, limits=limits) as http:
        threads = [threading.Thread(target=sender(r), args=(http,), daemon=True) for r in trace]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    return replies


def busy_throughput(replies: list[Reply], clients: int) -> tuple[float, float]:
    """(tokens/s, seconds) while every client had a request in flight: from the start to the
    moment the first client found the trace used up (the last request sent)."""
    if not replies:
        return 0.0, 0.0
    last_sent = max(r.sent for r in replies)
    end = last_sent if len(replies) > clients else max(r.finish or 0.0 for r in replies)
    if end <= 0:
        return 0.0, 0.0
    return sum(r.tokens_by(end) for r in replies) / end, end


def _send(http: httpx.Client, request: TraceRequest, body: Body, start: float) -> Reply:
    reply = Reply(request.id, monotonic() - start)
    payload = {
        "prompt": request.prompt,
        "max_tokens": request.max_new_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        **body(request),
    }
    for attempt in range(_STALE_RETRIES + 1):
        try:
            _read_stream(completion_chunks(http, payload), reply, start)
        except RefusedError as exc:
            reply.error = str(exc)
        except httpx.RemoteProtocolError as exc:
            # A kept-alive connection the server closed as the request went out: nothing was
            # answered, so the request is sent again on a new one, as browsers do.
            if not reply.chunks and attempt < _STALE_RETRIES:
                reply.retries += 1
                continue
            reply.error = f"{type(exc).__name__}: {exc}"
        except (httpx.HTTPError, ValueError, KeyError) as exc:
            reply.error = f"{type(exc).__name__}: {exc}"
        break
    reply.finish = monotonic() - start
    return reply


class RefusedError(Exception):
    """A completions request answered with another status than 200: the status and the text."""


def completion_chunks(http: httpx.Client, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """The chunks of the streamed answer to ``body`` on the completions route."""
    with http.stream("POST", "/v1/completions", json=body) as answer:
        if answer.status_code != 200:
            answer.read()
            raise RefusedError(f"{answer.status_code}: {answer.text[:200]}")
        for line in answer.iter_lines():
            if line.startswith("data:") and line[5:].strip() != "[DONE]":
                yield json.loads(line[5:])


def _read_stream(chunks: Iterator[dict[str, Any]], reply: Reply, start: float) -> None:
    usage = None
    for chunk in chunks:
        if "error" in chunk:
            reply.error = str(chunk["error"])[:200]
            return
        if chunk.get("usage"):
            usage = int(chunk["usage"]["completion_tokens"])
        if chunk.get("choices"):
            now = monotonic() - start
            if reply.first_token is None:
                reply.first_token = now
            reply.chunks.append(now)
    reply.tokens = usage if usage is not None else len(reply.chunks)
