"""The seams lora_guard.vllm relies on, checked by shape: a vLLM whose seams match passes, and a
changed one is named (its parameters, a missing field, a missing finish state)."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from lora_guard.vllm.seams import changed_seams


class Scheduler:
    def add_request(self, request: Any) -> None: ...
    def schedule(self, throttle_prefills: bool = False) -> Any: ...
    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any: ...
    def _free_request(self, request: Any, delay_free_blocks: bool = False) -> Any: ...
    def finish_requests(self, request_ids: Any, finished_status: Any) -> Any: ...


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[Any]
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int


@dataclass
class NewRequestData:
    req_id: str
    block_ids: tuple[list[int], ...]
    num_computed_tokens: int


class RequestStatus(enum.Enum):
    FINISHED_STOPPED = 1
    FINISHED_LENGTH_CAPPED = 2
    FINISHED_ABORTED = 3
    FINISHED_ERROR = 4


class FCFSRequestQueue:
    def add_request(self, request: Any) -> None: ...
    def remove_requests(self, requests: Any) -> None: ...


def seams(**changes: Any) -> list[str]:
    parts: dict[str, Any] = {
        "scheduler": Scheduler,
        "output": SchedulerOutput,
        "new_request": NewRequestData,
        "status": RequestStatus,
        "queues": (FCFSRequestQueue,),
    }
    return changed_seams(**{**parts, **changes})


def test_the_shapes_the_plugin_uses_pass() -> None:
    assert seams() == []


def test_renamed_parameters_are_named() -> None:
    class Renamed(Scheduler):
        def update_from_output(self, output: Any, runner_output: Any) -> Any: ...

    (changed,) = seams(scheduler=Renamed)
    assert "update_from_output" in changed and "runner_output" in changed


def test_a_missing_method_field_state_or_queue_method_is_named() -> None:
    class Gone(Scheduler):
        _free_request = None  # type: ignore[assignment]

    @dataclass
    class Output:
        scheduled_new_reqs: list[Any]
        num_scheduled_tokens: dict[str, int]

    class Status(enum.Enum):
        FINISHED_STOPPED = 1

    class Queue:
        def add_request(self, request: Any) -> None: ...

    changed = seams(scheduler=Gone, output=Output, status=Status, queues=(Queue,))
    assert len(changed) == 4
    assert any("_free_request" in c for c in changed)
    assert any("total_num_scheduled_tokens" in c for c in changed)
    assert any("FINISHED_LENGTH_CAPPED" in c for c in changed)
    assert any("remove_requests" in c for c in changed)
