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
from lora_guard.engine.outputs import JsonLog
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
    tokens = {
        "max_input_tokens": get("max_input_tokens") or max_total - 1,
        "max_total_tokens": max_total,
    }
    if not INPUT_BELOW_TOTAL.settle(tokens, lambda name: False):
        raise ValueError(INPUT_BELOW_TOTAL.message(lambda name: f"{name} ({tokens[name]})"))
    return Limits(
        max_concurrent_requests=get("max_concurrent_requests"),
        max_input_tokens=tokens["max_input_tokens"],
        max_total_tokens=max_total,
        max_stop_sequences=get("max_stop_sequences"),
    )


class StartError(Exception):
    """The server cannot start; ``code`` is the exit status (2: a bad API-key file)."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


def engine_for(settings: Any) -> tuple[LLMEngine, KeyRing | None, list[Path]]:
    """The engine, API keys and adapter folders of ``lora-guard serve`` settings
    (``ServeSettings``): the demo model and its adapters when no ``--model`` is given."""
    from lora_guard.engine.builder import build_engine
    from lora_guard.engine.lora import AdapterError
    from lora_guard.engine.spec import ModelLoadError
    from lora_guard.engine.threads import serial_thread
    from lora_guard.engine.values import ConfigError
    from lora_guard.plugins import PluginError

    # The engine steps on its own thread (AsyncEngine); this one, which builds it, stays serial so
    # that the step loop's is the process's only OpenMP team.
    serial_thread()
    keys = None
    if settings.api_key_file is not None:
        from lora_guard.server.auth import KeyFileError

        try:
            keys = KeyRing.from_file(settings.api_key_file)
        except KeyFileError as exc:
            raise StartError(str(exc), 2) from None
    kwargs = settings.engine_kwargs()
    if kwargs["model"] is None:
        from lora_guard.demo.model import DemoError, prepare_demo

        try:
            demo = prepare_demo()
        except DemoError as exc:
            raise StartError(str(exc)) from None
        kwargs["model"] = str(demo.model_dir)
        if kwargs["adapter_dir"] is None and not kwargs["adapters"]:
            kwargs["adapter_dir"] = demo.adapter_dir
    assert settings.hooks is not None
    try:
        engine = build_engine(
            settings.hooks, settings.policies, settings.plugin_settings(), **kwargs
        )
    except (ConfigError, ModelLoadError, AdapterError, PluginError, ValueError) as exc:
        raise StartError(str(exc)) from None
    adapter_dirs = [Path(d) for d in settings.adapter_dir]
    if kwargs["adapter_dir"] is not None and not adapter_dirs:
        adapter_dirs = [Path(kwargs["adapter_dir"])]  # the demo's
    return engine, keys, adapter_dirs


def state_for(
    engine: LLMEngine,
    settings: dict[str, Any],
    keys: KeyRing | None = None,
    adapter_dirs: list[Path] | None = None,
) -> ServerState:
    """What the routes share, for ``engine`` and the settings (``plugin_settings()``)."""
    from lora_guard.metrics import metrics_of

    metrics = metrics_of(engine.hooks.pm)
    if metrics is not None:
        metrics.model_name = engine.model_id  # the label routers match a base-model request by
        metrics.publish(engine.state())
    log_file = settings.get("request_log")
    return ServerState(
        AsyncEngine(engine),
        limits_for(engine, settings),
        metrics=metrics,
        keys=keys,
        adapter_dirs=list(adapter_dirs or []),
        request_log=JsonLog.open(
            None if log_file is None else str(log_file), setting="request_log"
        ),
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
    app = create_app(state_for(engine, settings, keys, adapter_dirs))
    config = uvicorn.Config(
        app, host=host, port=port, log_level="info", timeout_graceful_shutdown=GRACE_S
    )
    if keys is None:
        log.warning(
            "no --api-key-file: every route is open to whoever reaches the port, "
            "adapter administration and /metrics included"
        )
    log.info(
        "serving %s with %d adapters on http://%s:%d",
        engine.model_id,
        len(engine.adapter_ids()),
        host,
        port,
    )
    _Server(config).run()
    return 0
