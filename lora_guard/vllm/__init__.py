"""lora-guard inside vLLM: ``pip install 'lora-guard[vllm]'``, then turn on what a deployment
needs on ``vllm serve``'s command line (``docs/vllm.md``):

- ``--scheduler-cls lora_guard.vllm.AsyncScheduler`` (``lora_guard.vllm.Scheduler`` where async
  scheduling is off): hot-set admission, the cold-load budget and a starvation bound in vLLM's
  scheduler, and lora-guard's metrics;
- ``--middleware lora_guard.vllm.Door``: the cold-load budget's 429 at the door, the tenant
  passed to the scheduler, and lora-guard's metrics on vLLM's ``/metrics``;
- ``--middleware lora_guard.vllm.KVScope``: adapter- and tenant-scoped prefix-cache keys, set as
  each completion's ``cache_salt`` from the same KV-namespace policy as the bundled engine.

Tested on the vLLM versions in :data:`TESTED_VLLM`. The scheduler classes import vLLM, so they
load only when asked for.
"""

from __future__ import annotations

from typing import Any

from lora_guard.vllm.door import Door
from lora_guard.vllm.kv_scope import TESTED_VLLM, KVScope

__all__ = ["TESTED_VLLM", "AsyncScheduler", "Door", "KVScope", "Scheduler"]


def __getattr__(name: str) -> Any:
    if name in ("Scheduler", "AsyncScheduler"):
        from lora_guard.vllm import scheduler

        return getattr(scheduler, name)
    raise AttributeError(f"module 'lora_guard.vllm' has no attribute {name!r}")
