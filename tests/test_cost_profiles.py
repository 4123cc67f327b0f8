"""Cost profiles: a real model's shape sizes the adapters and the KV that virtual time counts."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

import pytest

from lora_guard.bench.virtual.replay import VirtualClock
from lora_guard.bench.virtual.schemes import Bench
from lora_guard.bench.virtual_time import weight_bytes
from lora_guard.cost_profiles import PROFILES, profile, profiles_markdown
from lora_guard.demo.adapters import named_specs, write_adapters
from lora_guard.demo.testing import make_tiny_llama
from lora_guard.simulate import main as simulate
from lora_guard.simulate_costs import MIB, Costs

LLAMA2_ATTENTION_PER_RANK = 4 * (4096 + 4096)  # q, k, v, o of Llama-2-7B: A and B, per layer


@pytest.mark.parametrize("name", sorted(PROFILES))
def test_every_profile_names_a_source_for_each_number(name: str) -> None:
    chosen = profile(name)
    costs = {f.name for f in fields(Costs)} - {"source", "adapter_mib"}
    sourced = set(chosen.sources)
    assert "memory" in sourced
    assert "costs" in sourced or costs <= sourced, costs - sourced
    assert all(text.strip() for text in chosen.sources.values())
    assert chosen.costs.source and chosen.memory_bytes > 0


@pytest.mark.parametrize("name", sorted(PROFILES))
def test_the_tiny_model_keeps_the_profiles_ratio_of_adapter_to_kv_bytes(name: str) -> None:
    shape = profile(name).shape
    tiny = shape.tiny()
    per_rank, per_token = shape.lora_bytes(1), shape.kv_bytes_per_token()
    assert tiny.lora_bytes(1) / tiny.kv_bytes_per_token() == pytest.approx(per_rank / per_token)
    assert tiny.hidden >= 64 and tiny.hidden % tiny.heads == 0


def test_a10_7b_counts_an_adapter_and_a_token_as_llama_2_7b_in_fp16_takes_them(
    tmp_path: Path,
) -> None:
    chosen = profile("a10-7b")
    model = make_tiny_llama(tmp_path / "model", **chosen.shape.tiny_config())
    folders = write_adapters(model, tmp_path / "adapters", named_specs({"attn": 8, "all": 16}))
    sizes = {f.name: weight_bytes(f) for f in folders}
    bench = Bench(
        model,
        tmp_path / "adapters",
        list(sizes),
        chosen,
        chosen.costs,
        scale=chosen.shape.scale(model),
        adapter_bytes=sizes,
    )
    mib = bench.profile_mib()
    assert mib["attn"] == pytest.approx(8 * LLAMA2_ATTENTION_PER_RANK * 32 * 2 / MIB)  # 16 MiB
    assert mib["all"] == pytest.approx(chosen.shape.lora_bytes(16) / MIB)  # 76.25 MiB
    llm = bench.llm(VirtualClock(), "lru", 16 * MIB, 2)
    try:
        memory, block_size = llm.engine.memory(), llm.engine.config.block_size
        per_token = memory.page_bytes * bench.scale / block_size
    finally:
        llm.engine.shutdown()
    assert per_token == 2 * 32 * 4096 * 2  # K and V, 32 layers, 4096 wide, fp16: 512 KiB
    # so one 16-token page is 8 MiB, and the rank-8 attention adapter takes exactly two pages
    assert bench.pages_bytes(["attn"]) * bench.scale == 16 * MIB


def test_simulate_takes_a_profile_and_refuses_an_unknown_one(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["--replicas", "2", "--adapters", "20", "--requests", "200", "--routers", "power-of-two"]
    assert simulate([*argv, "--profile", "h100-8b"]) == 0
    assert profile("h100-8b").costs.source in capsys.readouterr().out
    with pytest.raises(SystemExit):
        simulate([*argv, "--profile", "tpu"])
    assert "invalid choice: 'tpu'" in capsys.readouterr().err


def test_the_docs_show_the_profiles_as_the_code_has_them() -> None:
    doc = (Path(__file__).parents[1] / "docs" / "simulate.md").read_text()
    assert profiles_markdown() in doc, "python -m lora_guard.cost_profiles: paste into the docs"
