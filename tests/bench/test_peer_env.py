"""The field's tools' environments: made once, made again when a pin changes, named clearly."""

from __future__ import annotations

from pathlib import Path

import pytest

from lora_guard.bench.peer_env import PEERS, PeerEnv, main


def test_an_environment_is_made_once_and_again_for_another_pin(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LORA_GUARD_HOME", str(tmp_path))
    env = PeerEnv("empty", packages=())
    assert not env.ready
    python = env.make(log=lambda _msg: None)
    assert python == tmp_path / "peers" / "empty" / "bin" / "python" and python.exists()
    assert env.ready
    assert not PeerEnv("empty", packages=("guidellm==0.0.1",)).ready  # another pin: made again


def test_unknown_tools_are_refused_with_the_usage(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["vllm", "no-such-tool"]) == 2
    assert main([]) == 2
    assert "{" + ",".join(PEERS) + "}" in capsys.readouterr().err
