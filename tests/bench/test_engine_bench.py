"""``python -m lora_guard.bench.engine`` on the tiny model: the engine and PEFT in turn."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lora_guard.bench.engine import main
from lora_guard.demo.testing import AdapterFactory


def test_the_engine_bench_runs_the_engine_and_peft_in_turn_and_prints_each_runs_ratios(
    tiny_model: Path,
    tiny_adapters: AdapterFactory,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    adapters = tiny_adapters(2, "speed", ranks=(4, 8), all_projections=True)
    out = tmp_path / "speed.json"
    argv = [
        "--model",
        str(tiny_model),
        "--adapter-dir",
        str(next(iter(adapters.values())).parent),
        "--adapters",
        "2",
        "--batches",
        "1,4",
        "--new-tokens",
        "4",
        "--repeats",
        "2",
        "--json",
        str(out),
    ]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "medians of 2 runs; each run's ratios:" in printed
    found = json.loads(out.read_text())
    assert found["prefix_caching"] is False  # PEFT computes every prompt: so does the engine
    assert "the engine's prefix caching off" in printed
    rows = found["rows"]
    assert [r["batch"] for r in rows] == [1, 4]
    for row in rows:
        assert row["bytes_floor"] > 1 and len(row["speedup_runs"]) == 2
        assert row["engine_mixed_tokens_per_s"] > 0 and row["peft_mixed_tokens_per_s"] > 0
        assert row["engine_mixed_prefill_ms"] > 0 and row["peft_mixed_prefill_ms"] > 0
        assert row["speedup_over_peft"] == pytest.approx(sum(row["speedup_runs"]) / 2)
        assert f"batch {row['batch']}: mixed / floor" in printed


def test_the_engine_bench_mixes_the_adapters_named_and_refuses_an_unknown_one(
    tiny_model: Path,
    tiny_adapters: AdapterFactory,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    adapters = tiny_adapters(3, "pick", ranks=(4, 8), all_projections=True)
    folder = str(next(iter(adapters.values())).parent)
    chosen = sorted(adapters)[2]
    argv = [
        "--model",
        str(tiny_model),
        "--adapter-dir",
        folder,
        "--adapter-ids",
        chosen,
        "--batches",
        "1",
        "--new-tokens",
        "4",
        "--skip-peft",
        "--json",
        str(tmp_path / "skip.json"),
    ]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert f"mixed batches cycle over 1 adapters: {chosen};" in printed
    assert "nan" not in printed  # PEFT's columns say "-": not measured
    (row,) = json.loads((tmp_path / "skip.json").read_text())["rows"]
    assert row["peft_mixed_tokens_per_s"] is None and row["engine_mixed_tokens_per_s"] > 0
    assert main([*argv[:4], "--adapter-ids", "nobody", "--skip-peft"]) == 2
    assert "no adapter 'nobody'" in capsys.readouterr().err
