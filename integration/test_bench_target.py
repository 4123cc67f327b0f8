"""`lora-guard bench --target`: the same trace replayed against a running server over HTTP."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from lora_guard.demo.testing import ServerProcess


def test_a_trace_replayed_on_a_server_completes_and_matches_the_oracle(
    server: ServerProcess, tiny: tuple[Path, Path], tmp_path: Path
) -> None:
    model, adapters = tiny
    report_path = tmp_path / "report.json"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "lora_guard.cli",
            "bench",
            "--target",
            server.url,
            "--adapters",
            "3",
            "--tenants",
            "2",
            "--requests",
            "12",
            "--rate",
            "6",
            "--output-mean",
            "12",
            "--system-prompt-words",
            "12",
            "--user-words",
            "6",
            "--model",
            str(model),
            "--adapter-dir",
            str(adapters),
            "--json",
            str(report_path),
            "--write-trace",
            str(tmp_path / "trace.jsonl"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(report_path.read_text())
    target = report["schemes"]["target"]
    assert target["requests"] == target["completed"] == 12
    assert target["oracle_mismatches"] == 0
    assert target["kv_conflicts"] == 0
    # Lookups and swaps come from the server's own metrics, as differences over the run.
    assert 0 <= target["hit_rate"] <= 1
    assert target["swaps"] >= 1 and target["swap_ms_p95"] is not None
    assert target["peak_memory_ratio"] is None  # a remote server's memory is not measured
    assert "| target |" in done.stdout


def test_an_unreachable_target_is_a_clear_error(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "lora_guard.cli", "bench", "--target", "http://127.0.0.1:9"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert done.stderr.startswith("error:") and "Traceback" not in done.stderr
