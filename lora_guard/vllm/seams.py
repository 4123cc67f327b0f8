"""The parts of vLLM that ``lora_guard.vllm`` relies on (its seams), checked by their shapes when
vLLM starts the plugin, not by vLLM's version string: a release whose seams match runs the
policies; one where a seam changed runs as vLLM alone, and its log says which seam changed.

vLLM's scheduler is not a public interface. The plugin overrides five of its methods, reads a few
fields of its batch output and finish states, and moves requests in and out of its waiting queue;
those are the seams. Nothing here imports vLLM: :func:`scheduler_seams` does, when asked.
"""

from __future__ import annotations

import dataclasses
import enum
import inspect
from collections.abc import Callable
from typing import Any

#: method -> the parameters it must start with (the plugin overrides it with these)
METHODS = {
    "add_request": ("self", "request"),
    "schedule": ("self",),
    "update_from_output": ("self", "scheduler_output", "model_runner_output"),
    "_free_request": ("self", "request"),
    "finish_requests": ("self", "request_ids", "finished_status"),
}
OUTPUT_FIELDS = ("num_scheduled_tokens", "scheduled_new_reqs", "total_num_scheduled_tokens")
NEW_REQUEST_FIELDS = ("req_id", "block_ids", "num_computed_tokens")
QUEUE_METHODS = ("add_request", "remove_requests")
FINISH_STATES = ("FINISHED_LENGTH_CAPPED", "FINISHED_ABORTED", "FINISHED_ERROR")


def changed_seams(
    scheduler: type,
    output: type,
    new_request: type,
    status: type[enum.Enum],
    queues: tuple[type, ...],
) -> list[str]:
    """Each seam that does not have the shape the plugin uses, described; empty when all do."""
    changed = []
    for name, expected in METHODS.items():
        method: Callable[..., Any] | None = getattr(scheduler, name, None)
        if method is None:
            changed.append(f"{scheduler.__name__}.{name} is gone")
            continue
        found = tuple(inspect.signature(method).parameters)[: len(expected)]
        if found != expected:
            changed.append(f"{scheduler.__name__}.{name}{found} was {name}{expected}")
    for cls, wanted in ((output, OUTPUT_FIELDS), (new_request, NEW_REQUEST_FIELDS)):
        fields = (
            {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
        )
        missing = [f for f in wanted if f not in fields]
        if missing:
            changed.append(f"{cls.__name__} lacks {', '.join(missing)}")
    missing = [s for s in FINISH_STATES if s not in status.__members__]
    if missing:
        changed.append(f"{status.__name__} lacks {', '.join(missing)}")
    for queue in queues:
        missing = [m for m in QUEUE_METHODS if not callable(getattr(queue, m, None))]
        if missing:
            changed.append(f"{queue.__name__} lacks {', '.join(missing)}")
    return changed


def scheduler_seams() -> list[str]:
    """:func:`changed_seams` of the installed vLLM."""
    from vllm.v1.core.sched import request_queue
    from vllm.v1.core.sched.output import NewRequestData, SchedulerOutput
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.request import RequestStatus

    queues = tuple(
        cls
        for _, cls in inspect.getmembers(request_queue, inspect.isclass)
        if cls.__module__ == request_queue.__name__
        and not inspect.isabstract(cls)
        and hasattr(cls, "add_request")
    )
    return changed_seams(Scheduler, SchedulerOutput, NewRequestData, RequestStatus, queues)
