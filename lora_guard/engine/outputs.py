"""What the engine gives back: each request's state after a step, and a record of each step."""

from __future__ import annotations

import json
import logging
import os
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any, TextIO

from lora_guard.engine.sequence import Sequence
from lora_guard.engine.values import ConfigError

log = logging.getLogger(__name__)


@dataclass(slots=True)
class RequestOutput:
    """A request's state after a step: everything generated so far."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    logprobs: list[float]
    finished: bool
    finish_reason: str | None
    num_cached_tokens: int = 0
    error: str | None = None
    stop_sequence: str | None = None
    retry_after: float | None = None  # set when a policy answered "busy, retry later"
    held_s: float = 0.0  # seconds a policy left it out of the batch while it waited
    adapter_wait_s: float = 0.0  # seconds it waited for its adapter before its first token
    # From its arrival, on the engine's clock: to the start of the first step that computed it
    # and to its end (None until then); and the steps that computed it, summed (wall seconds).
    queue_s: float | None = None
    finished_s: float | None = None
    step_s: float = 0.0

    @classmethod
    def of(cls, seq: Sequence, text: str, stop_sequence: str | None = None) -> RequestOutput:
        return cls(
            request_id=seq.request_id,
            prompt_token_ids=seq.prompt_token_ids,
            token_ids=seq.output_token_ids,
            text=text,
            logprobs=list(seq.logprobs),
            finished=seq.finish_reason is not None,
            finish_reason=seq.finish_reason.value if seq.finish_reason else None,
            num_cached_tokens=seq.num_cached_tokens,
            error=seq.error,
            stop_sequence=stop_sequence,
            retry_after=seq.retry_after,
            held_s=seq.held_s,
            adapter_wait_s=seq.first_adapter_wait_s,
            queue_s=_since(seq.arrival_time, seq.first_step_time),
            finished_s=_since(seq.arrival_time, seq.finished_time),
            step_s=seq.step_s,
        )


def _since(start: float, moment: float | None) -> float | None:
    return None if moment is None else moment - start


@dataclass(frozen=True, slots=True)
class StepRecord:
    """What one step computed and how long it took: a fleet's step log, to which
    ``lora-guard simulate``'s step cost can be fitted (``simulate_costs.fit_steps``)."""

    step: int  # the engine's step count after it
    finished_at: float  # seconds since the epoch at its end (``clock.wall``)
    seconds: float  # wall time, from scheduling to the observers told of it
    seqs: int
    adapters: int  # distinct adapters in the batch
    adapter_bytes: int  # their weights, which the batch read
    prefill_tokens: int
    loads: int  # adapters written into the pool in the step


RECENT_STEPS = 4096


@dataclass
class EngineStats:
    steps: int = 0
    preemptions: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    recent_steps: deque[StepRecord] = field(default_factory=lambda: deque(maxlen=RECENT_STEPS))


STEP_LOG_MAX_BYTES = 64 * 2**20  # then FILE becomes FILE.1 (one kept) and a new FILE begins
STEP_LOG_CHECK_EVERY = 256  # lines between two looks at the file's size


class JsonLog:
    """One JSON line a record (a step's, ``--step-log FILE``; a request's, ``--request-log
    FILE``), line buffered: each line one append, so replicas may share a file. Past
    ``max_bytes`` the file is renamed ``FILE.1`` (the one before it dropped) and a new one
    begins; a writer whose file another replica renamed follows to the new one. A failed write
    stops the log, never the engine."""

    def __init__(
        self,
        path: str | None,
        file: TextIO | None,
        max_bytes: int = STEP_LOG_MAX_BYTES,
        setting: str = "step_log",
    ) -> None:
        self.path, self.file, self.max_bytes, self.setting = path, file, max_bytes, setting
        self.lines = 0

    @classmethod
    def open(
        cls, path: str | None, max_bytes: int = STEP_LOG_MAX_BYTES, setting: str = "step_log"
    ) -> JsonLog:
        try:
            file = open(path, "a", buffering=1) if path else None  # noqa: SIM115 (kept open)
            return cls(path, file, max_bytes, setting)
        except OSError as exc:
            raise ConfigError(f"{setting}: cannot write {path}: {exc.strerror}") from None

    def _rotate_when_full(self) -> None:
        assert self.file is not None and self.path is not None
        mine = os.fstat(self.file.fileno())
        try:
            named = os.stat(self.path)
            renamed = (named.st_ino, named.st_dev) != (mine.st_ino, mine.st_dev)
        except FileNotFoundError:
            renamed = True
        if not renamed and mine.st_size < self.max_bytes:
            return
        if not renamed:
            os.replace(self.path, self.path + ".1")
        self.file.close()
        self.file = open(self.path, "a", buffering=1)  # noqa: SIM115 (open for the engine's life)

    @property
    def writing(self) -> bool:
        return self.file is not None

    def write(self, record: Any) -> None:
        """``record``: a dataclass instance, one line of its fields."""
        if self.file is None:
            return
        try:
            self.file.write(json.dumps(asdict(record)) + "\n")
            self.lines += 1
            if self.lines % STEP_LOG_CHECK_EVERY == 0:
                self._rotate_when_full()
        except OSError as exc:  # a full disk
            log.warning("%s %s stopped: %s", self.setting.replace("_", " "), self.path, exc)
            self.file = None

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
