"""What a request must be to enter the engine, checked on the engine thread before it is queued."""

from __future__ import annotations

from dataclasses import dataclass

from lora_guard.engine.errors import RequestError
from lora_guard.engine.lora.registry import AdapterRegistry
from lora_guard.engine.sampling import SamplingParams


@dataclass(frozen=True, slots=True)
class RequestCheck:
    registry: AdapterRegistry
    vocab_size: int
    max_model_len: int
    static_adapter: str | None = None  # the static baseline serves this adapter only

    def adapter(self, adapter_id: str | None) -> None:
        if adapter_id is not None:
            self.registry.require(adapter_id)
        static = self.static_adapter
        if static is not None and adapter_id != static:
            raise RequestError(
                f"this engine serves only adapter {static!r}, merged into the base weights "
                "(policy static)"
            )

    def prompt(self, token_ids: list[int], params: SamplingParams) -> None:
        if not token_ids:
            raise RequestError("the prompt is empty")
        if any(not 0 <= t < self.vocab_size for t in token_ids):
            raise RequestError("the prompt holds token ids outside the vocabulary")
        if len(token_ids) + params.max_new_tokens > self.max_model_len:
            raise RequestError(
                f"`inputs` tokens + `max_new_tokens` must be <= {self.max_model_len}. "
                f"Given: {len(token_ids)} `inputs` tokens and {params.max_new_tokens} "
                "`max_new_tokens`"
            )
