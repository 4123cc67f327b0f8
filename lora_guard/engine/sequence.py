"""One request's state inside the engine."""

from __future__ import annotations

import enum
from collections.abc import Hashable
from dataclasses import dataclass, field

import torch

from lora_guard.engine.sampling import SamplingParams
from lora_guard.plugins.state import RequestView


@dataclass(frozen=True, slots=True)
class CacheScope:
    """The weights a request's KV is computed under: the base model, the adapter (None: the base
    model alone) and the adapter's content hash. Cached blocks record it; a hit under another
    scope is a conflict. Equal only to another ``CacheScope``, so a plugin's namespace never
    collides with it."""

    base_model: str
    adapter_id: str | None = None
    adapter_hash: str | None = None


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    LENGTH = "length"
    EOS = "eos_token"
    STOP = "stop_sequence"
    ABORT = "abort"
    ERROR = "error"


@dataclass(eq=False)
class Sequence:
    """Tokens, KV blocks and progress of one request.

    ``token_ids`` holds the prompt then the generated tokens; ``num_computed_tokens`` of them have
    their KV in the cache. A preempted sequence frees its blocks and computes them again later.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    adapter_id: str | None
    tenant_id: str = "default"
    arrival_time: float = 0.0
    cache_salt: str | None = None
    cache_namespace: Hashable = None
    cache_scope: CacheScope | None = None
    waited_steps: int = 0
    adapter_looked_up: bool = False
    status: Status = Status.WAITING
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    block_keys: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    adapter_hash: str | None = None  # the adapter weights it started under
    adapter_needed_at: float | None = None  # when it began to wait for its adapter
    parked_since: float | None = None  # running, but its adapter is out of the pool
    held_since: float | None = None  # waiting, left out of the batch by a policy since then
    held_s: float = 0.0  # time left out of the batch by a policy, ended spells
    first_adapter_wait_s: float = 0.0  # time waiting for its adapter before its first token
    adapter_ready_once: bool = False
    finish_reason: FinishReason | None = None
    error: str | None = None
    retry_after: float | None = None
    generator: torch.Generator | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    first_step_time: float | None = None  # when the first step that computed it began
    step_s: float = 0.0  # wall seconds of the steps that computed it, summed

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED

    def view(self) -> RequestView:
        return RequestView(
            request_id=self.request_id,
            adapter_id=self.adapter_id,
            tenant_id=self.tenant_id,
            num_prompt_tokens=self.num_prompt_tokens,
            num_output_tokens=len(self.token_ids) - self.num_prompt_tokens,
            arrival_time=self.arrival_time,
            waited_steps=self.waited_steps,
            cache_salt=self.cache_salt,
            max_new_tokens=self.params.max_new_tokens,
            first_token_time=self.first_token_time,
            finished_time=self.finished_time,
            held_s=self.held_s,
        )

    def hold(self, now: float, held: bool) -> None:
        """Whether a policy leaves it out of the batch being formed (``lora_guard_batch_form``)."""
        if held and self.held_since is None:
            self.held_since = now
        elif not held and self.held_since is not None:
            self.held_s += now - self.held_since
            self.held_since = None
