"""Multi-LoRA in the engine, in vLLM's seams:

- ``checkpoint``: reading a PEFT folder into host memory, checked against the base model;
- ``registry``: which adapters exist (the id rule, the folder scan);
- ``loader``: the loader thread and the host-memory tier;
- ``pool``: the one cache pool that KV blocks and adapter pages share;
- ``residency``: which adapters are in the pool, decided step by step;
- ``compute``: the LoRA update of one step.
"""

from __future__ import annotations

from lora_guard.engine.lora.checkpoint import AdapterError, LoRAAdapter, read_adapter

__all__ = ["AdapterError", "LoRAAdapter", "read_adapter"]
