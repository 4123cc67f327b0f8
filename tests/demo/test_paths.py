from __future__ import annotations

from pathlib import Path

import pytest

from lora_guard.demo.paths import DemoPaths, lora_guard_home


def test_home_comes_from_lora_guard_home(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("LORA_GUARD_HOME", str(tmp_path / "lg"))
    assert lora_guard_home() == tmp_path / "lg"
    assert DemoPaths.under().model_dir == tmp_path / "lg" / "demo" / "model"


def test_home_defaults_to_the_user_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("LORA_GUARD_HOME", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert lora_guard_home() == tmp_path / "lora-guard"
