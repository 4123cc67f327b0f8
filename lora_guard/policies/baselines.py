"""Baselines to compare the guard policies with.

- ``lru``: what vLLM and SGLang do by default: any request may load its adapter, into the least
  recently used idle slot; no budget, no batch shaping. The engine's own default behaviour.
- ``on-demand``: the naive scheme: one adapter at a time is merged into the base weights (the
  engine's merged mode), so a step serves one adapter or the base model, and every switch waits
  for the running requests to drain, then unmerges and merges.
- ``static``: one adapter (``static_adapter``) merged into the base weights for good, as one
  instance per adapter would be; requests for anything else are refused.
"""

from __future__ import annotations

from collections.abc import Sequence

from lora_guard.plugins import hookimpl
from lora_guard.plugins.options import OptionRegistry
from lora_guard.plugins.state import EngineState, RequestView

DRAIN_AFTER_STEPS = 16


class LRUPolicy:
    """No hooks: the engine's default decisions are LRU."""


class StaticPolicy:
    """No hooks: the engine's merged mode with ``static_adapter`` does the work."""

    @hookimpl
    def lora_guard_add_options(self, options: OptionRegistry) -> None:
        options.add("static_adapter", str, None, "policy static: the one adapter to serve")


class OnDemandPolicy:
    @hookimpl
    def lora_guard_batch_form(
        self, waiting: Sequence[RequestView], running: Sequence[RequestView], state: EngineState
    ) -> list[str]:
        if running and waiting and waiting[0].waited_steps >= DRAIN_AFTER_STEPS:
            return []  # let the running batch drain so the oldest request's adapter gets its turn
        if running:
            current = running[0].adapter_id
        elif waiting:
            current = waiting[0].adapter_id
        else:
            return []
        return [r.request_id for r in waiting if r.adapter_id == current]
