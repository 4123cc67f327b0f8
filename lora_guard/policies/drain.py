"""``drain``: SGLang's LoRA drainer (``sglang/srt/lora/lora_drainer.py``) on lora-guard's hooks.

Adapters leave least recently used first, as with ``lru``. Besides: when the requests of an
adapter that is not resident have waited more than ``DRAIN_AFTER_S`` (3 s, SGLang's
``MAX_WAIT_TIME_SECS``), the resident adapter whose running requests have the fewest tokens left
is drained for it: its new requests are held back (unless they would end within 1.2x the
tokens its running requests have left, SGLang's tolerance), so it empties and its room goes to
the starving adapter. An adapter stops draining once no running request uses it.
"""

from __future__ import annotations

from collections.abc import Sequence

from lora_guard.plugins import hookimpl
from lora_guard.plugins.state import EngineState, RequestView
from lora_guard.policies.baselines import LRUPolicy

DRAIN_AFTER_S = 3.0
TOLERANCE = 1.2


class DrainPolicy(LRUPolicy):
    def __init__(self) -> None:
        self.draining: dict[str, str] = {}  # draining adapter -> the starving one it drains for

    @hookimpl
    def lora_guard_batch_form(
        self, waiting: Sequence[RequestView], running: Sequence[RequestView], state: EngineState
    ) -> list[str]:
        left: dict[str, int] = {}  # running adapter -> most tokens a request of it has left
        for r in running:
            if r.adapter_id is not None:
                remaining = r.max_new_tokens - r.num_output_tokens
                left[r.adapter_id] = max(left.get(r.adapter_id, 0), remaining)
        self.draining = {a: s for a, s in self.draining.items() if a in left}
        waited: dict[str, float] = {}
        for r in waiting:
            if r.adapter_id is not None:
                waited[r.adapter_id] = max(
                    waited.get(r.adapter_id, 0.0), state.now - r.arrival_time
                )
        resident = {v.adapter_id for v in state.slots if v.adapter_id is not None}
        starving = sorted(
            (
                a
                for a, w in waited.items()
                if w > DRAIN_AFTER_S and a not in resident and a not in self.draining.values()
            ),
            key=lambda a: -waited[a],
        )
        for adapter in starving:
            eligible = [a for a in left if a not in self.draining]
            if not eligible:
                break
            self.draining[min(eligible, key=left.__getitem__)] = adapter
        return [
            r.request_id
            for r in waiting
            if r.adapter_id not in self.draining
            or r.max_new_tokens <= left[r.adapter_id] * TOLERANCE
        ]
