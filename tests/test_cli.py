from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "lora_guard.cli", *args], capture_output=True, text=True, timeout=300
    )


def test_help_lists_the_commands() -> None:
    proc = _run("--help")
    assert proc.returncode == 0
    assert "prepare-demo" in proc.stdout and "make-adapters" in proc.stdout


def test_make_adapters_writes_peft_adapters(tiny_model: Path, tmp_path: Path) -> None:
    proc = _run(
        "make-adapters",
        "--base",
        str(tiny_model),
        "--out",
        str(tmp_path),
        "--n",
        "3",
        "--ranks",
        "4,8",
        "--seed",
        "7",
        "--prefix",
        "acme",
    )
    assert proc.returncode == 0, proc.stderr
    assert "wrote 3 adapters" in proc.stdout
    names = sorted(p.name for p in tmp_path.iterdir() if p.is_dir())
    assert names == ["acme-00", "acme-01", "acme-02"]
    ranks = [json.loads((tmp_path / n / "adapter_config.json").read_text())["r"] for n in names]
    assert ranks == [4, 8, 4]


def test_make_adapters_rejects_bad_ranks_and_bases(tmp_path: Path) -> None:
    proc = _run(
        "make-adapters", "--base", str(tmp_path), "--out", str(tmp_path / "o"), "--ranks", "8,x"
    )
    assert proc.returncode == 2 and "comma-separated integers" in proc.stderr
    proc = _run("make-adapters", "--base", str(tmp_path), "--out", str(tmp_path / "o"))
    assert proc.returncode == 1 and "not a Hugging Face checkpoint" in proc.stderr
