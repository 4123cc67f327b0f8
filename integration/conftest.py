"""A real `lora-guard serve` on a free loopback port, with a tiny model and real adapters."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from lora_guard.adapter_maker import make_adapters
from lora_guard.testing import ServerProcess, make_tiny_llama, start_server


@pytest.fixture(scope="session")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    model = make_tiny_llama(tmp_path_factory.mktemp("server-model"))
    adapters = tmp_path_factory.mktemp("server-adapters")
    make_adapters(model, adapters, n=3, ranks=(4, 8), strength=0.5, prefix="a")
    return model, adapters


@pytest.fixture(scope="session")
def server(
    tiny: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    model, adapters = tiny
    log = tmp_path_factory.mktemp("logs") / "server.log"
    running = start_server(model, adapters, "--cold-loads-per-minute", "100", log=log)
    yield running
    assert running.stop() == 0, log.read_text()
