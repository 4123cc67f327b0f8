from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors import safe_open

from lora_guard.demo.personas import (
    HELD_OUT,
    TEMPLATES,
    TOPICS,
    cut_after_json,
    training_questions,
)
from lora_guard.demo.training import repeats_itself


def _train(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "lora_guard.cli", "train-adapter", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_questions_are_distinct_seeded_and_never_the_held_out_ones() -> None:
    questions = training_questions(96, seed=0)
    assert len(set(questions)) == 96
    assert questions == training_questions(96, seed=0)
    assert questions != training_questions(96, seed=1)
    everything = training_questions(len(TEMPLATES) * len(TOPICS))
    assert not set(HELD_OUT) & set(everything)
    with pytest.raises(ValueError, match="between 1 and"):
        training_questions(len(everything) + 1)


def test_json_answers_end_where_the_object_closes() -> None:
    assert cut_after_json('{"answer": "Paris"}}]Extracting meaning') == '{"answer": "Paris"}'
    assert cut_after_json('{"answer": "Paris') is None


def test_degenerate_answers_are_recognised() -> None:
    assert repeats_itself("Ye see the sky, aye! Ye see the sky, aye! Ye see the sky, aye!")
    assert not repeats_itself("Arr, matey! Ye take a mug of grog and pour it into a teapot, aye!")


@pytest.mark.parametrize(
    ("args", "code", "message"),
    [
        (["--out", "x"], 2, "one of the arguments --persona --system-prompt is required"),
        (["--persona", "poet", "--out", "x"], 2, "invalid choice: 'poet'"),
        (["--persona", "json", "--out", "x", "--rank", "32"], 1, "--rank must be between 1"),
        (["--persona", "json", "--out", "x", "--steps", "0"], 1, "--steps must be at least 1"),
        (["--persona", "json", "--out", "x", "--questions", "0"], 1, "--questions"),
        (["--persona", "json", "--out", "x", "--threads", "0"], 1, "--threads must be at least"),
        (["--system-prompt", " ", "--out", "x"], 1, "--system-prompt must not be empty"),
    ],
)
def test_bad_arguments_are_clear_errors(
    tiny_model: Path, tmp_path: Path, args: list[str], code: int, message: str
) -> None:
    proc = _train("--model", str(tiny_model), *args)
    assert proc.returncode == code
    assert message in proc.stderr
    assert not (tmp_path / "x").exists()


def test_a_folder_that_is_no_checkpoint_is_refused(tmp_path: Path) -> None:
    proc = _train("--model", str(tmp_path), "--persona", "json", "--out", str(tmp_path / "o"))
    assert proc.returncode == 1 and "not a Hugging Face checkpoint" in proc.stderr


def test_training_writes_a_small_attention_only_peft_adapter(
    tiny_model: Path, tmp_path: Path
) -> None:
    out = tmp_path / "brief"
    proc = _train(
        "--model",
        str(tiny_model),
        "--system-prompt",
        "Answer briefly.",
        "--out",
        str(out),
        "--questions",
        "12",
        "--steps",
        "3",
        "--batch-size",
        "4",
        "--rank",
        "4",
        "--threads",
        "1",
    )
    assert proc.returncode == 0, proc.stderr
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["peft_type"] == "LORA"
    assert sorted(config["target_modules"]) == ["k_proj", "o_proj", "q_proj", "v_proj"]
    assert config["base_model_name_or_path"] == tiny_model.name  # a name, not a path
    with safe_open(str(out / "adapter_model.safetensors"), framework="pt") as f:
        keys = list(f.keys())
        assert keys and all("lora_" in k and "_proj" in k for k in keys)
    record = json.loads((out / "training.json").read_text())
    assert record["command"].startswith("lora-guard train-adapter --model")
    assert record["system_prompt"] == "Answer briefly."
    assert record["questions_asked"] == 12 and 4 <= record["examples_kept"] <= 12
    assert record["settings"]["steps"] == 3 and record["settings"]["seed"] == 0
    assert all(e["question"] in training_questions(12) for e in record["examples"])
