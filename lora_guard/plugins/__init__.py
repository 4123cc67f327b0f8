"""Plugins: the hook contract, the plugin manager and what hooks see and return."""

from __future__ import annotations

import pluggy

from lora_guard.plugins.hookspecs import PROJECT

hookimpl = pluggy.HookimplMarker(PROJECT)

from lora_guard.plugins.decisions import BusyRetry, Defer, Load, Reject  # noqa: E402
from lora_guard.plugins.manager import Hooks, PluginError, make_plugin_manager  # noqa: E402
from lora_guard.plugins.state import EngineState, RequestView, SlotView  # noqa: E402

__all__ = [
    "BusyRetry",
    "Defer",
    "EngineState",
    "Hooks",
    "Load",
    "PluginError",
    "Reject",
    "RequestView",
    "SlotView",
    "hookimpl",
    "make_plugin_manager",
]
