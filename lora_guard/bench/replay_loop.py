"""A trace replayed on an engine, on whichever clock the replay keeps: the one loop that the
wall-clock replay (``replay.py``) and virtual time (``virtual/replay.py``) share.

Each request is added when its time comes; one the engine turns away with a retry-after (a 429)
is sent again once that time has passed, as a client would, and its record counts the retries.
Every request ends in tokens or an error.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterator, Sequence
from typing import Protocol

from lora_guard.bench.load import RequestRecord
from lora_guard.engine import SamplingParams
from lora_guard.engine.llm_engine import LLMEngine, RequestError
from lora_guard.engine.outputs import RequestOutput
from lora_guard.workload.trace import TraceRequest


class ReplayClock(Protocol):
    """How time passes in a replay: what now is, how idle time goes by, and one engine step."""

    def now(self) -> float:
        """Seconds since the replay began."""

    def idle(self, until: float) -> None:
        """Nothing to run before ``until``, the next attempt's time (it may come sooner). A clock
        that jumps must land at ``until`` or after, as ``now`` reads it."""

    def step(self) -> list[RequestOutput]:
        """One engine step, and the time it takes."""


def replay_loop(
    engine: LLMEngine,
    trace: Sequence[TraceRequest],
    clock: ReplayClock,
    adapters: bool = True,
    arrived: Callable[[RequestRecord], None] = lambda record: None,
    prompt: Callable[[TraceRequest], str | list[int]] = lambda request: request.prompt,
) -> Attempts:
    """Replay ``trace`` on ``engine`` (``adapters`` False: every request on the base model);
    ``arrived`` is told of each request's first attempt as it is added, ``prompt`` gives what is
    sent of it."""
    attempts = Attempts(trace, adapters)
    while attempts.open:
        due = attempts.due[0][0] if attempts.due else None
        if not engine.has_unfinished_requests() and due is not None and due > clock.now():
            clock.idle(due)  # no step while nothing runs: an empty one still calls the hooks
            continue
        now = clock.now()
        for attempt, request, record in attempts.arrivals(now):
            if not record.retries:
                arrived(record)
            params = SamplingParams(max_new_tokens=request.max_new_tokens, ignore_eos=True)
            try:
                engine.add_request(
                    attempt, prompt(request), params, record.adapter_id, tenant_id=request.tenant
                )
            except RequestError as exc:
                attempts.refused(attempt, str(exc), now)
        outputs = clock.step()  # answers given as requests were added (a 429) come here too
        now = clock.now()
        for out in outputs:
            attempts.note(out, now)
    return attempts


class Attempts:
    """A trace's requests on their way through an engine: each arrival, and each 429 sent again
    once its retry-after has passed, is an attempt ``<id>#<retries>`` of the request's own."""

    def __init__(self, trace: Sequence[TraceRequest], adapters: bool = True) -> None:
        self.records = {
            r.id: RequestRecord(r.id, r.adapter_id if adapters else None, r.time) for r in trace
        }
        self.requests = {r.id: r for r in trace}
        self.due = [(r.time, i, r.id) for i, r in enumerate(trace)]  # (time, tiebreak, id)
        heapq.heapify(self.due)
        self.attempt_of: dict[str, str] = {}  # engine request id -> trace id
        self.open = len(trace)  # requests without their tokens or their error yet
        self.resent = 0  # 429s sent again
        self._tiebreak = len(trace)

    def arrivals(self, now: float) -> Iterator[tuple[str, TraceRequest, RequestRecord]]:
        """The attempts due by ``now``: each one's engine request id, request and record."""
        while self.due and self.due[0][0] <= now:
            _, _, trace_id = heapq.heappop(self.due)
            record = self.records[trace_id]
            attempt = f"{trace_id}#{record.retries}"
            self.attempt_of[attempt] = trace_id
            yield attempt, self.requests[trace_id], record

    def refused(self, attempt: str, error: str, now: float) -> None:
        """The engine would not take ``attempt``: its request ends in ``error``."""
        record = self.records[self.attempt_of.pop(attempt)]
        record.error, record.finish = error, now
        self.open -= 1

    def note(self, out: RequestOutput, now: float) -> None:
        """An engine output of an attempt, ``now`` seconds into the replay."""
        record = self.records[self.attempt_of[out.request_id]]
        if out.token_ids and record.first_token is None:
            record.first_token = now
        if not out.finished:
            return
        del self.attempt_of[out.request_id]
        if out.error is not None and out.retry_after is not None:
            record.retries += 1
            self.resent += 1
            self._tiebreak += 1
            heapq.heappush(self.due, (now + out.retry_after, self._tiebreak, record.id))
            return
        record.finish, record.tokens, record.error = now, list(out.token_ids), out.error
        record.held_s += out.held_s
        record.adapter_wait_s += out.adapter_wait_s
        self.open -= 1
