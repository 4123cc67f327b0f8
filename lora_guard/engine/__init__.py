"""The bundled reference engine: paged KV, continuous batching, multi-LoRA slots.

The names below are imported when first read (``from lora_guard.engine import LLM``): the engine
imports torch, and ``lora_guard.engine.config`` (the settings table of the command line and the
docs) must not, so that ``lora-guard --help`` and the settings' checks start at once.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lora_guard.engine.config import EngineConfig
    from lora_guard.engine.errors import RequestError, UnknownAdapterError
    from lora_guard.engine.llm import LLM
    from lora_guard.engine.llm_engine import LLMEngine
    from lora_guard.engine.lora import AdapterError
    from lora_guard.engine.outputs import RequestOutput
    from lora_guard.engine.sampling import InvalidParams, SamplingParams
    from lora_guard.engine.spec import ModelLoadError
    from lora_guard.engine.values import ConfigError, parse_memory

#: Each public name and the module it comes from.
_HOMES = {
    "LLM": "lora_guard.engine.llm",
    "AdapterError": "lora_guard.engine.lora",
    "ConfigError": "lora_guard.engine.config",
    "EngineConfig": "lora_guard.engine.config",
    "InvalidParams": "lora_guard.engine.sampling",
    "LLMEngine": "lora_guard.engine.llm_engine",
    "ModelLoadError": "lora_guard.engine.spec",
    "RequestError": "lora_guard.engine.errors",
    "RequestOutput": "lora_guard.engine.outputs",
    "SamplingParams": "lora_guard.engine.sampling",
    "UnknownAdapterError": "lora_guard.engine.errors",
    "parse_memory": "lora_guard.engine.config",
}

__all__ = [
    "LLM",
    "AdapterError",
    "ConfigError",
    "EngineConfig",
    "InvalidParams",
    "LLMEngine",
    "ModelLoadError",
    "RequestError",
    "RequestOutput",
    "SamplingParams",
    "UnknownAdapterError",
    "parse_memory",
]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value  # read once: later reads find it here
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
