"""lora-guard's settings inside vLLM: ``LORA_GUARD_*`` variables and the file ``LORA_GUARD_CONFIG``
names, read as ``lora-guard serve`` reads them (names and checks in docs/config.md)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from lora_guard.plugins.manager import Hooks


def configured_hooks(
    environ: Mapping[str, str] = os.environ, **overrides: Any
) -> tuple[Hooks, dict[str, Any]]:
    """The plugins the settings choose, configured, and the plugins' options; ``overrides`` are
    what vLLM decides itself (``max_loras``)."""
    from lora_guard.config import load_settings

    settings = load_settings([], environ)
    options = {**settings.options, **overrides}
    settings.hooks.configure(options)
    return settings.hooks, options
