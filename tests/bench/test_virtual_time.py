"""The virtual-time replay: the real engine and policies, figures that do not move with the
machine's load."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lora_guard.bench.virtual_time import main, virtual_clock

ARGS = ["--requests", "16", "--adapters", "8", "--max-loras", "2", "--output-mean", "24",
        "--schemes", "lru,lora-guard"]  # fmt: skip


def test_the_same_command_gives_the_same_figures_on_a_busy_machine(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([*ARGS, "--json", str(tmp_path / "quiet.json")]) == 0
    burner = subprocess.Popen([sys.executable, "-c", "while True: pass"])  # another process's load
    try:
        assert main([*ARGS, "--json", str(tmp_path / "busy.json")]) == 0
    finally:
        burner.kill()
        burner.wait()
    quiet = json.loads((tmp_path / "quiet.json").read_text())
    busy = json.loads((tmp_path / "busy.json").read_text())
    assert quiet == busy
    schemes = quiet["schemes"]
    assert set(schemes) == {"lru", "lora-guard"}
    for row in schemes.values():
        assert row["completed"] == row["requests"] == 16
        assert row["loads"] > 0  # 2 seats, 8 adapters: loads
        assert 0 < row["ttft_p50_ms"] <= row["ttft_p95_ms"]
        assert row["hit_rate"] <= row["hit_rate_bound"]
    assert set(quiet["tenants"]) and all(set(t) == set(schemes) for t in quiet["tenants"].values())
    out = capsys.readouterr().out
    assert "| lru |" in out and "| lora-guard |" in out and "max_loras 2" in out


def test_the_clock_is_the_real_one_again_after_the_block() -> None:
    real = time.monotonic
    with pytest.raises(RuntimeError), virtual_clock() as clock:
        clock.now += 5
        assert time.monotonic() == clock.now
        raise RuntimeError("a failed replay")
    assert time.monotonic is real


def test_an_unknown_scheme_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--schemes", "lru,fastest"])
    assert "unknown scheme 'fastest'" in capsys.readouterr().err
