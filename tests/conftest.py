from __future__ import annotations

from pathlib import Path

import pytest

from lora_guard.paths import DemoPaths
from lora_guard.testing import make_tiny_llama


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random two-layer Llama checkpoint with its own tokenizer, made once per session."""
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def demo() -> DemoPaths:
    """The demo model and adapters in the user's lora-guard home, prepared if missing."""
    from lora_guard.demo import prepare_demo

    return prepare_demo(log=lambda _msg: None)
