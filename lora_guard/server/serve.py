"""``lora-guard serve``: settings -> engine -> HTTP server, until SIGTERM or Ctrl-C.

On SIGTERM the server stops accepting connections, lets requests in flight finish for up to
``GRACE_S`` seconds, then aborts what is left, frees the engine and exits 0.
"""

from __future__ import annotations

import contextlib
import logging
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import uvicorn

from lora_guard.config import INPUT_BELOW_TOTAL, SETTINGS_BY_NAME
from lora_guard.engine.async_engine import AsyncEngine
from lora_guard.engine.llm_engine import LLMEngine
from lora_guard.server.app import create_app
from lora_guard.server.auth import KeyRing
from lora_guard.server.state import Limits, ServerState

GRACE_S = 30
log = logging.getLogger("lora_guard.server")


def limits_for(engine: LLMEngine, settings: dict[str, Any]) -> Limits:
    """The request limits in ``settings`` (``ServeSettings.plugin_settings()``), each missing one
    at its default; the total is capped at the engine's ``max_model_len``."""

    def get(name: str) -> Any:
        value = settings.get(name)
        return SETTINGS_BY_NAME[name].default if value is None else int(value)

    max_total = min(get("max_total_tokens") or engine.max_model_len, engine.max_model_len)
    tokens = {"max_input_tokens": get("max_input_tokens") or max_total - 1,
              "max_total_tokens": max_total}  # fmt: skip
    if not INPUT_BELOW_TOTAL.settle(tokens, lambda name: False):
        raise ValueError(INPUT_BELOW_TOTAL.message(lambda name: f"{name} ({tokens[name]})"))
    return Limits(
        max_concurrent_requests=get("max_concurrent_requests"),
        max_input_tokens=tokens["max_input_tokens"],
        max_total_tokens=max_total,
        max_stop_sequences=get("max_stop_sequences"),
    )


class _Server(uvicorn.Server):
    """uvicorn, but a SIGTERM or Ctrl-C ends in a graceful shutdown and exit status 0 (uvicorn
    re-raises the signal after shutting down, which makes the exit status -15)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        signals = (signal.SIGINT, signal.SIGTERM)
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in signals}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def serve(
    engine: LLMEngine,
    host: str,
    port: int,
    settings: dict[str, Any],
    keys: KeyRing | None = None,
    adapter_dirs: list[Path] | None = None,
) -> int:
    from lora_guard.metrics import metrics_of

    state = ServerState(
        AsyncEngine(engine), limits_for(engine, settings), metrics=metrics_of(engine.hooks.pm),
        keys=keys, adapter_dirs=list(adapter_dirs or []),
    )  # fmt: skip
    app = create_app(state)
    config = uvicorn.Config(
        app, host=host, port=port, log_level="info", timeout_graceful_shutdown=GRACE_S
    )
    if keys is None:
        log.warning("no --api-key-file: every route is open to whoever reaches the port, "
                    "adapter administration and /metrics included")  # fmt: skip
    log.info("serving %s with %d adapters on http://%s:%d", engine.model_id,
             len(engine.adapters.registry.entries), host, port)  # fmt: skip
    _Server(config).run()
    return 0
