"""lora-guard: serve many LoRA adapters on one base model, with guardrails."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

__all__ = ["LLM", "RequestOutput", "SamplingParams", "__version__", "hookimpl"]

if TYPE_CHECKING:
    from lora_guard.engine import LLM, RequestOutput, SamplingParams
    from lora_guard.plugins import hookimpl


def __getattr__(name: str) -> Any:
    # The engine imports torch; keep `import lora_guard` (and the CLI's start) light.
    if name == "hookimpl":
        from lora_guard.plugins import hookimpl

        return hookimpl
    if name in ("LLM", "RequestOutput", "SamplingParams"):
        from lora_guard import engine

        return getattr(engine, name)
    raise AttributeError(f"module 'lora_guard' has no attribute {name!r}")
