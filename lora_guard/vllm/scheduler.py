"""vLLM's scheduler with lora-guard's admission: ``vllm serve ... --scheduler-cls
lora_guard.vllm.AsyncScheduler`` (or ``lora_guard.vllm.Scheduler`` where async scheduling is off).

Before each of vLLM's scheduling passes the waiting requests that lora-guard's policies hold back
(batch form leaves them out, or their adapter load is deferred) leave vLLM's waiting queue; vLLM's
own pass runs unchanged on the rest, and the held requests go back in arrival order. So vLLM keeps
its token budget, KV allocation, preemption and ``max_loras`` gate, and the policies decide who
may join. vLLM's scheduler is not a public interface: at start the seams this module uses are
checked (:mod:`lora_guard.vllm.seams`); where one changed, one log line says which and the
scheduler runs as vLLM's own, without the policies.
"""

from __future__ import annotations

import logging
from typing import Any

import vllm
from vllm.v1.core.sched.async_scheduler import AsyncScheduler as VllmAsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler as VllmScheduler
from vllm.v1.request import RequestStatus

from lora_guard.vllm import channel
from lora_guard.vllm.guard import SchedulerGuard
from lora_guard.vllm.seams import scheduler_seams

FINISH_REASONS = {
    getattr(RequestStatus, state): reason
    for state, reason in (
        ("FINISHED_LENGTH_CAPPED", "length"),
        ("FINISHED_ABORTED", "abort"),
        ("FINISHED_ERROR", "error"),
    )
    if hasattr(RequestStatus, state)  # a missing one is a changed seam (seams.py)
}


log = logging.getLogger("lora_guard.vllm")


class GuardedScheduling:
    """The part shared by both scheduler classes: vLLM's methods, wrapped."""

    guard: SchedulerGuard | None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.guard = None  # vLLM's own scheduling, until the seams are known to match
        changed = scheduler_seams()
        if changed:
            log.warning(
                "lora_guard.vllm is off: vLLM %s changed %s; vLLM schedules on its own",
                vllm.__version__,
                "; ".join(changed),
            )
            return
        lora = self.lora_config  # type: ignore[attr-defined]
        if lora is None:
            raise RuntimeError("lora_guard.vllm's scheduler needs --enable-lora")
        self.guard = SchedulerGuard(
            max_loras=lora.max_loras,
            max_cpu_loras=lora.max_cpu_loras or lora.max_loras,
            num_blocks=self.cache_config.num_gpu_blocks,  # type: ignore[attr-defined]
            block_size=self.block_size,  # type: ignore[attr-defined]
            folder=channel.channel_dir(channel.front_end_pid()),
        )
        model = getattr(getattr(self, "vllm_config", None), "model_config", None)
        self.guard.serve_model(str(getattr(model, "served_model_name", "") or ""))

    def add_request(self, request: Any) -> None:
        super().add_request(request)  # type: ignore[misc]
        if self.guard is not None:
            self.guard.arrived(request)

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        if self.guard is None:
            return super().schedule(*args, **kwargs)  # type: ignore[misc]
        waiting = self.waiting  # type: ignore[attr-defined]
        queued = list(waiting)
        held_ids = self.guard.hold_back(queued, list(self.running))  # type: ignore[attr-defined]
        held = [r for r in queued if r.request_id in held_ids]
        if held:
            waiting.remove_requests(held)
        try:
            output = super().schedule(*args, **kwargs)  # type: ignore[misc]
        finally:
            if held:
                left = list(waiting)
                waiting.remove_requests(left)
                for request in sorted([*left, *held], key=lambda r: r.arrival_time):
                    waiting.add_request(request)
        unfinished = [*self.running, *self.waiting]  # type: ignore[attr-defined]
        self.guard.scheduled(output, self.requests, unfinished)  # type: ignore[attr-defined]
        return output

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
        outputs = super().update_from_output(  # type: ignore[misc]
            scheduler_output, model_runner_output
        )
        if self.guard is None:
            return outputs
        self.guard.step_done(
            scheduler_output,
            list(self.waiting),  # type: ignore[attr-defined]
            list(self.running),  # type: ignore[attr-defined]
        )
        return outputs

    def finish_requests(self, request_ids: Any, finished_status: Any) -> Any:
        """Requests finished from outside a step (a client left): the state is published
        again, or a door would read the seats of the last step until the next one, which an
        idle engine never takes."""
        finished = super().finish_requests(request_ids, finished_status)  # type: ignore[misc]
        if self.guard is not None and finished:
            waiting, running = list(self.waiting), list(self.running)  # type: ignore[attr-defined]
            self.guard.publish(self.guard.state(waiting, running))
        return finished

    def _free_request(self, request: Any, *args: Any, **kwargs: Any) -> Any:
        if self.guard is not None:
            reason = FINISH_REASONS.get(request.status)
            if reason is None:
                reason = "stop_sequence" if isinstance(request.stop_reason, str) else "eos_token"
            self.guard.finished(request, reason)
        return super()._free_request(request, *args, **kwargs)  # type: ignore[misc]


class Scheduler(GuardedScheduling, VllmScheduler):
    """vLLM's ``Scheduler`` with lora-guard's admission."""


class AsyncScheduler(GuardedScheduling, VllmAsyncScheduler):
    """vLLM's ``AsyncScheduler`` (async scheduling, vLLM's default where it is on) with
    lora-guard's admission."""
