"""The bundled reference engine: paged KV, continuous batching, multi-LoRA slots."""

from __future__ import annotations

from lora_guard.engine.config import ConfigError, EngineConfig, parse_memory
from lora_guard.engine.errors import RequestError, UnknownAdapterError
from lora_guard.engine.llm import LLM
from lora_guard.engine.llm_engine import LLMEngine
from lora_guard.engine.lora import AdapterError
from lora_guard.engine.outputs import RequestOutput
from lora_guard.engine.sampling import InvalidParams, SamplingParams
from lora_guard.engine.spec import ModelLoadError

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
