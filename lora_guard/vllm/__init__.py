"""lora-guard inside vLLM: ``pip install 'lora-guard[vllm]'``, then turn on what a deployment
needs on ``vllm serve``'s command line (``docs/vllm.md``):

- ``--middleware lora_guard.vllm.KVScope``: adapter- and tenant-scoped prefix-cache keys, set as
  each completion's ``cache_salt`` from the same KV-namespace policy as the bundled engine.

Tested on the vLLM versions in :data:`TESTED_VLLM`.
"""

from __future__ import annotations

from lora_guard.vllm.kv_scope import TESTED_VLLM, KVScope

__all__ = ["TESTED_VLLM", "KVScope"]
