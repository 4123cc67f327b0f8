"""What one step computes, as the scheduler plans it and the runner carries it out: the
sequences and their new tokens (with the adapter each computes with), those preempted, those
failed, and the KV blocks to copy first."""

from __future__ import annotations

from dataclasses import dataclass, field

from lora_guard.engine.lora.seats import Resident
from lora_guard.engine.sequence import Sequence


@dataclass(slots=True)
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int
    adapter: Resident | None = None  # the adapter weights it computes with in this step


@dataclass(slots=True)
class Failure:
    """A request the scheduler could not serve; ``retry_after`` is set for a busy answer."""

    seq: Sequence
    reason: str
    retry_after: float | None = None


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    failed: list[Failure] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)  # KV blocks to copy, (from, to)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    def prefill_tokens(self) -> int:
        """Tokens of prompts computed in the step: all but decodes' (ask before it advances)."""
        return sum(
            s.num_new_tokens
            for s in self.scheduled
            if s.seq.num_computed_tokens + 1 < len(s.seq.token_ids)
        )

    def adapter_bytes(self) -> list[int]:
        """Bytes of each distinct adapter the step computes with."""
        adapters = {id(s.adapter): s.adapter.layout.nbytes for s in self.scheduled if s.adapter}
        return list(adapters.values())
