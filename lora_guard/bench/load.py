"""The bench's one HTTP load client: a trace's requests sent to a server and what came back.

How the requests go: a closed loop of N clients (each sends the trace's next request once its
last is answered), or each at its trace time on its own thread, whatever is still running (open
loop; ``lora-guard bench --target`` and the vLLM peer replay the same way). What they ask: a
:class:`Route` says the path, the body and how a streamed event carries output: OpenAI's
completions route (:func:`completions`) or TGI's ``/generate_stream`` (:func:`tgi_generate`).
Every answer is streamed and timed per event, so a closed loop's throughput is read while all N
clients are busy, not while the last few drain. A 429 is sent again after its ``Retry-After``, a
kept-alive connection the server had closed is sent again on a new one; each request ends in a
:class:`RequestRecord` with its tokens or its error.
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

TIMEOUT_S = 900.0
_STALE_RETRIES = 2  # a kept-alive connection closed under a request that got no answer
_MAX_RETRIES = 100  # 429s

# What a system adds to a request's body (its adapter's name, or a per-request LoRA list).
Body = Callable[[TraceRequest], dict[str, Any]]


@dataclass
class RequestRecord:
    """What a client saw of one request. Times are seconds from the start of the run."""

    id: str
    adapter_id: str | None
    arrival: float  # its trace time
    first_token: float | None = None
    finish: float | None = None
    tokens: list[int] = field(default_factory=list)  # the ids generated, where the answer says
    retries: int = 0
    error: str | None = None
    held_s: float = 0.0  # left out of the batch by a policy (in-process replays only)
    adapter_wait_s: float = 0.0  # waiting for its adapter before its first token (in-process)
    sent: float | None = None  # when its client sent it (over HTTP)
    chunks: list[float] = field(default_factory=list)  # when each event with output came
    usage: int | None = None  # the tokens the server counted (OpenAI's ``usage``)

    @property
    def generated(self) -> int:
        """Tokens generated: the server's count, else the ids, else the events with output."""
        if self.usage is not None:
            return self.usage
        return len(self.tokens) or len(self.chunks)

    def tokens_by(self, moment: float) -> float:
        """Tokens out by ``moment``: the count spread evenly over the events (servers differ in
        what an event holds: a token, a token with no text yet, the finish)."""
        if not self.chunks:
            return 0.0
        return self.generated * sum(1 for t in self.chunks if t <= moment) / len(self.chunks)


def _no_headers(request: TraceRequest) -> dict[str, str]:
    return {}


@dataclass(frozen=True)
class Route:
    """Where a request goes and how its streamed answer reads: ``output`` gives an event's token
    ids ([] when it has output but no ids), None when it has no output."""

    path: str
    body: Callable[[TraceRequest], dict[str, Any]]
    output: Callable[[dict[str, Any]], list[int] | None]
    headers: Callable[[TraceRequest], dict[str, str]] = _no_headers


def completions(extra: Body, prompt_ids: dict[str, list[int]] | None = None) -> Route:
    """OpenAI's completions route: the trace's prompt (as text, or as the ids ``prompt_ids``
    gives by request, whose answers then carry their token ids), ``max_tokens`` = its
    ``max_new_tokens``, greedy, ``ignore_eos`` (every system generates exactly what was asked),
    the usage counted, and what ``extra`` adds (the system's name for the adapter)."""

    def body(request: TraceRequest) -> dict[str, Any]:
        prompt: str | list[int] = request.prompt
        ids: dict[str, Any] = {}
        if prompt_ids is not None:
            prompt, ids = prompt_ids[request.id], {"return_token_ids": True}
        return {
            "prompt": prompt,
            "max_tokens": request.max_new_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
            **ids,
            **extra(request),
        }

    def output(event: dict[str, Any]) -> list[int] | None:
        if not event.get("choices"):
            return None
        if prompt_ids is None:
            return []
        ids = [int(i) for i in event["choices"][0].get("token_ids") or []]
        return ids or None

    return Route("/v1/completions", body, output)


def tgi_generate() -> Route:
    """TGI's ``/generate_stream``: the adapter in ``parameters.adapter_id``, the tenant in
    ``X-Tenant-Id``."""

    def body(request: TraceRequest) -> dict[str, Any]:
        parameters: dict[str, Any] = {"max_new_tokens": request.max_new_tokens, "details": True}
        if request.adapter_id is not None:
            parameters["adapter_id"] = request.adapter_id
        return {"inputs": request.prompt, "parameters": parameters}

    def output(event: dict[str, Any]) -> list[int] | None:
        return [int(event["token"]["id"])] if "token" in event else None

    return Route("/generate_stream", body, output, lambda r: {"X-Tenant-Id": r.tenant})


def client(url: str, connections: int = 100, headers: dict[str, str] | None = None) -> httpx.Client:
    """An HTTP client of ``url`` that keeps ``connections`` connections open at once."""
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    return httpx.Client(base_url=url.rstrip("/"), timeout=TIMEOUT_S, limits=limits, headers=headers)


def records_of(trace: list[TraceRequest]) -> dict[str, RequestRecord]:
    return {r.id: RequestRecord(r.id, r.adapter_id, r.time) for r in trace}


def closed_loop(
    url: str, trace: list[TraceRequest], clients: int, route: Route
) -> list[RequestRecord]:
    """``clients`` clients, each sending the trace's next request as soon as its last one ended;
    a request's ``arrival`` is when it was sent."""
    start, records = monotonic(), records_of(trace)

    def one(http: httpx.Client, request: TraceRequest) -> RequestRecord:
        record = records[request.id]
        record.arrival = monotonic() - start
        send(http, request, record, start, route)
        return record

    return testing.closed_loop(url, trace, one, clients, timeout_s=TIMEOUT_S)


def open_loop(
    http: httpx.Client,
    trace: list[TraceRequest],
    route: Route,
    while_running: Callable[[float], None] | None = None,
    every_s: float = 0.5,
) -> tuple[list[RequestRecord], float]:
    """Each request sent at its trace time on its own thread, whatever is still running;
    ``while_running(seconds since the start)`` is called every ``every_s`` until the last answer.
    The records in the trace's order, and the seconds from the start to the last answer."""
    start, records = monotonic(), records_of(trace)

    def at_its_time(request: TraceRequest) -> None:
        time.sleep(max(0.0, request.time - (monotonic() - start)))
        send(http, request, records[request.id], start, route)

    threads = [threading.Thread(target=at_its_time, args=(r,), daemon=True) for r in trace]
    for thread in threads:
        thread.start()
    while any(t.is_alive() for t in threads):
        time.sleep(every_s)
        if while_running is not None:
            while_running(monotonic() - start)
    return list(records.values()), monotonic() - start


def busy_throughput(records: list[RequestRecord], clients: int) -> tuple[float, float]:
    """(tokens/s, seconds) while every client had a request in flight: from the start to the
    moment the first client found the trace used up (the last request sent)."""
    if not records:
        return 0.0, 0.0
    last_sent = max(r.sent or 0.0 for r in records)
    end = last_sent if len(records) > clients else max(r.finish or 0.0 for r in records)
    if end <= 0:
        return 0.0, 0.0
    return sum(r.tokens_by(end) for r in records) / end, end


def send(
    http: httpx.Client, request: TraceRequest, record: RequestRecord, start: float, route: Route
) -> None:
    """Send ``request`` by ``route`` now and read its streamed answer into ``record``."""
    record.sent = monotonic() - start
    stale = 0
    while True:
        try:
            # X-Request-Id: a server's request log names the request by it (time_split)
            body, headers = (
                route.body(request),
                {**route.headers(request), "X-Request-Id": request.id},
            )
            with http.stream("POST", route.path, json=body, headers=headers) as answer:
                if answer.status_code == 429 and record.retries < _MAX_RETRIES:
                    record.retries += 1
                    time.sleep(float(answer.headers.get("retry-after", "1")))
                    continue
                if answer.status_code != 200:
                    answer.read()
                    record.error = f"{answer.status_code}: {answer.text[:200]}"
                else:
                    _read(_events(answer.iter_lines()), route, record, start)
        except httpx.RemoteProtocolError as exc:
            # A kept-alive connection the server closed as the request went out: nothing was
            # answered, so the request is sent again on a new one, as browsers do.
            if not record.chunks and stale < _STALE_RETRIES:
                stale += 1
                record.retries += 1
                continue
            record.error = f"{type(exc).__name__}: {exc}"
        except (httpx.HTTPError, ValueError, KeyError) as exc:
            record.error = f"{type(exc).__name__}: {exc}"
        break
    record.finish = monotonic() - start


def _events(lines: Iterator[str]) -> Iterator[dict[str, Any]]:
    for line in lines:
        if line.startswith("data:") and line[5:].strip() != "[DONE]":
            event: dict[str, Any] = json.loads(line[5:])
            yield event


def _read(
    events: Iterator[dict[str, Any]], route: Route, record: RequestRecord, start: float
) -> None:
    for event in events:
        if "error" in event:
            record.error = str(event["error"])[:200]
            return
        if event.get("usage"):
            record.usage = int(event["usage"]["completion_tokens"])
        ids = route.output(event)
        if ids is None:
            continue
        now = monotonic() - start
        if record.first_token is None:
            record.first_token = now
        record.chunks.append(now)
        record.tokens.extend(ids)
