"""Baselines to compare the guard policies with.

- ``lru``: what vLLM and SGLang do by default: any request may load its adapter, into the least
  recently used idle slot; no budget, no batch shaping. The engine's own default behaviour.
- ``on-demand``: the naive scheme: every switch loads the adapter from disk again (no host tier is
  relied on) and a step serves one adapter (plus the base model).
"""

from __future__ import annotations

from collections.abc import Sequence

from lora_guard.plugins import hookimpl
from lora_guard.plugins.state import EngineState, RequestView


class LRUPolicy:
    """No hooks: the engine's default decisions are LRU."""


class OnDemandPolicy:
    @hookimpl
    def lora_guard_batch_form(
        self, waiting: Sequence[RequestView], running: Sequence[RequestView], state: EngineState
    ) -> list[str]:
        current = {r.adapter_id for r in running if r.adapter_id is not None}
        if not current:
            first = next((r.adapter_id for r in waiting if r.adapter_id is not None), None)
            current = {first} if first else set()
        return [r.request_id for r in waiting if r.adapter_id is None or r.adapter_id in current]
