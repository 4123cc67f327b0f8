"""lora-guard: serve many LoRA adapters on one base model, with guardrails."""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__"]
