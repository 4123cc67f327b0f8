"""Where each generation request's time went, one JSON line a request (``--request-log FILE``).

From its arrival at the server to its answer's last byte, on the engine's clock: the queue (its
prompt tokenized and admitted, then waiting for its first step), the engine steps that computed
it, the engine's time between those steps (other steps, the loop's hand-offs, holds), and the
HTTP after its end in the engine (the last events written). Keyed by the client's
``X-Request-Id`` where it sends one, so a load client can add its own side (``lora-guard bench
--sweep`` does: docs/benchmarks.md).
"""

from __future__ import annotations

from dataclasses import dataclass

from lora_guard.engine.outputs import RequestOutput


@dataclass(frozen=True, slots=True)
class RequestTimes:
    """One request's line; the four parts add up to ``total_s`` (seconds)."""

    id: str  # the client's X-Request-Id, else the engine's request id
    request_id: str  # the engine's
    route: str
    finish_reason: str | None  # None: the client left before the end
    prompt_tokens: int
    generated_tokens: int
    total_s: float  # arrival to the last byte
    queue_s: float  # arrival to the start of its first step
    step_s: float  # the steps that computed it, summed
    between_steps_s: float  # from its first step to its end in the engine, outside its steps
    http_s: float  # its end in the engine to the last byte

    @classmethod
    def of(
        cls, out: RequestOutput, total_s: float, route: str, client_id: str | None
    ) -> RequestTimes:
        ended = min(out.finished_s if out.finished_s is not None else total_s, total_s)
        queue = min(out.queue_s if out.queue_s is not None else ended, ended)
        step = min(out.step_s, ended - queue)
        return cls(
            id=client_id or out.request_id,
            request_id=out.request_id,
            route=route,
            finish_reason=out.finish_reason,
            prompt_tokens=len(out.prompt_token_ids),
            generated_tokens=len(out.token_ids),
            total_s=total_s,
            queue_s=queue,
            step_s=step,
            between_steps_s=ended - queue - step,
            http_s=total_s - ended,
        )
