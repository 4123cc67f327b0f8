"""Baselines to compare the guard policies with.

- ``lru``: what vLLM and SGLang do by default: any request may load its adapter; when room is
  short, the least recently used adapters that no running request uses leave; no budget, no
  batch shaping.
- ``fifo``: SGLang's other ``--lora-eviction-policy``: the same, the adapter loaded first leaving
  first.
- ``on-demand``: the naive scheme: one adapter at a time is merged into the base weights (the
  engine's merged mode), so a step serves one adapter or the base model, and every switch waits
  for the running requests to drain, then unmerges and merges.
- ``static``: one adapter (``static_adapter``) merged into the base weights for good, as one
  instance per adapter would be; requests for anything else are refused.
"""

from __future__ import annotations

from collections.abc import Sequence

from lora_guard.plugins import hookimpl
from lora_guard.plugins.decisions import AdapterDecision
from lora_guard.plugins.options import OptionRegistry
from lora_guard.plugins.state import EngineState, RequestView, SlotView
from lora_guard.policies.victims import idle_residents, plan_load

DRAIN_AFTER_STEPS = 16


class EvictionOrder:
    """A warm adapter takes free room, else the room of idle residents (no running request uses
    them) in the order :meth:`order` gives. Subclasses give the order."""

    def order(self, idle: list[SlotView], state: EngineState) -> list[SlotView]:
        raise NotImplementedError

    @hookimpl
    def lora_guard_adapter_load(
        self, request: RequestView, tier: str, state: EngineState
    ) -> AdapterDecision | None:
        if tier == "cold" or request.adapter_id is None:
            return None  # reading into host memory needs no room in the pool
        return plan_load(state, request, self.order(idle_residents(state), state))


class LRUPolicy(EvictionOrder):
    """vLLM's ``LRUCache`` of LoRAs and SGLang's default: least recently used first."""

    def order(self, idle: list[SlotView], state: EngineState) -> list[SlotView]:
        return sorted(idle, key=lambda v: v.last_used)


class FIFOPolicy(EvictionOrder):
    """SGLang's ``--lora-eviction-policy fifo``: loaded first, first to leave."""

    def order(self, idle: list[SlotView], state: EngineState) -> list[SlotView]:
        return sorted(idle, key=lambda v: v.loaded_at)


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
