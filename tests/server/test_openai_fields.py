"""Fields the OpenAI routes do not use are logged once each, and only so many: a client sending
ever new names cannot grow the server's memory."""

from __future__ import annotations

import logging

import pytest

from lora_guard.server import routes_openai
from lora_guard.server.protocol import CompletionRequest


def test_unknown_fields_are_logged_once_and_the_names_kept_are_bounded(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(routes_openai, "_IGNORED_SEEN", set())
    body = CompletionRequest(prompt="x", logit_bias_v2=1, mystery=True)  # type: ignore[call-arg]
    with caplog.at_level(logging.DEBUG, logger=routes_openai.__name__):
        routes_openai._log_ignored(body)
        routes_openai._log_ignored(body)
    named = [r.getMessage() for r in caplog.records]
    assert len(named) == 2 and any("'mystery'" in m for m in named)
    flood = CompletionRequest(prompt="x", **{f"f{i}": i for i in range(1000)})
    routes_openai._log_ignored(flood)
    assert len(routes_openai._IGNORED_SEEN) == routes_openai._IGNORED_LOGGED
