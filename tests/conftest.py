from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from lora_guard.demo.adapters import make_adapters
from lora_guard.demo.paths import DemoPaths
from lora_guard.demo.testing import AdapterFactory, SoloGreedy, make_tiny_llama


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random two-layer Llama checkpoint with its own tokenizer, made once per session."""
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_adapters(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> AdapterFactory:
    """Makes PEFT adapters for the tiny model, by id: ``tiny_adapters(n, prefix, ranks=(4,))``
    (more keywords go to ``make_adapters``)."""

    def make(n: int, prefix: str, ranks: tuple[int, ...] = (4,), **kwargs: Any) -> dict[str, Path]:
        out = tmp_path_factory.mktemp(f"{prefix}-adapters")
        made = make_adapters(tiny_model, out, n=n, ranks=ranks, prefix=prefix, **kwargs)
        return {folder.name: folder for folder in made}

    return make


@pytest.fixture(scope="module")
def solo(tiny_model: Path, adapters: dict[str, Path]) -> Iterator[SoloGreedy]:
    """Greedy tokens of one request run alone, without prefix caching (memoised), over the
    module's ``adapters``."""
    runner = SoloGreedy(tiny_model, adapters)
    yield runner
    runner.close()


@pytest.fixture(scope="session")
def demo() -> DemoPaths:
    """The demo model and adapters in the user's lora-guard home, prepared if missing."""
    from lora_guard.demo.model import prepare_demo

    return prepare_demo(log=lambda _msg: None)
