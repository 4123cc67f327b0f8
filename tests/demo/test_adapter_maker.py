from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from lora_guard.demo.adapters import (
    ATTENTION_MODULES,
    MLP_MODULES,
    AdapterMakerError,
    make_adapters,
    plan_adapters,
)


@pytest.fixture(scope="module")
def adapters(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    out = tmp_path_factory.mktemp("adapters")
    return make_adapters(tiny_model, out, n=8, ranks=(2, 4, 8, 16), seed=0, prefix="t")


def _logits(model: torch.nn.Module) -> torch.Tensor:
    ids = torch.tensor([[5, 17, 42, 99, 7, 3]])
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_every_adapter_loads_with_peft_and_changes_the_logits(
    tiny_model: Path, adapters: list[Path]
) -> None:
    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    reference = _logits(base)
    for folder in adapters:
        model = PeftModel.from_pretrained(base, folder)
        changed = (_logits(model) - reference).abs().max().item()
        assert changed > 1e-3, f"{folder.name} leaves the logits unchanged"
        base = model.unload()
    assert torch.equal(_logits(base), reference), "unloading must restore the base model"


def test_adapters_follow_the_plan(adapters: list[Path]) -> None:
    index = json.loads((adapters[0].parent / "adapters.json").read_text())["adapters"]
    assert [a["name"] for a in index] == [f.name for f in adapters]
    ranks, targets, rslora = set(), set(), set()
    for folder, entry in zip(adapters, index, strict=True):
        config = json.loads((folder / "adapter_config.json").read_text())
        assert config["peft_type"] == "LORA"
        assert config["r"] == entry["rank"] and config["lora_alpha"] == 2 * entry["rank"]
        assert set(config["target_modules"]) == set(entry["target_modules"])
        assert (folder / "adapter_model.safetensors").is_file()
        assert not list(folder.glob("*.bin")), "adapters must be safetensors only"
        ranks.add(config["r"])
        targets.add(frozenset(config["target_modules"]))
        rslora.add(config["use_rslora"])
    assert ranks == {2, 4, 8, 16}
    assert targets == {frozenset(ATTENTION_MODULES), frozenset(ATTENTION_MODULES + MLP_MODULES)}
    assert rslora == {True, False}


def test_same_seed_same_adapter_other_seed_other_adapter(
    tiny_model: Path, adapters: list[Path], tmp_path: Path
) -> None:
    again = make_adapters(tiny_model, tmp_path / "same", n=1, ranks=(2,), seed=0, prefix="t")[0]
    other = make_adapters(tiny_model, tmp_path / "other", n=1, ranks=(2,), seed=1, prefix="t")[0]
    first = load_file(adapters[0] / "adapter_model.safetensors")
    same = load_file(again / "adapter_model.safetensors")
    different = load_file(other / "adapter_model.safetensors")
    assert first.keys() == same.keys() == different.keys()
    assert all(torch.equal(first[k], same[k]) for k in first)
    assert not any(torch.equal(first[k], different[k]) for k in first)


def test_plan_rejects_bad_arguments() -> None:
    with pytest.raises(AdapterMakerError, match="--n"):
        plan_adapters(0, (8,))
    with pytest.raises(AdapterMakerError, match="--ranks"):
        plan_adapters(2, (8, 0))


def test_base_without_checkpoint_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(AdapterMakerError, match=r"no config\.json"):
        make_adapters(tmp_path, tmp_path / "out", n=1)
