"""The FLOPs a generated token costs, counted from a real checkpoint's config and a real adapter's
header, against the tensors themselves."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file

from lora_guard.bench.ceiling import Ceiling, TokenWork, machine_share
from lora_guard.demo.testing import AdapterFactory
from lora_guard.workload.trace import TraceRequest


def test_a_tokens_flops_are_two_per_weight_it_multiplies_plus_attention(
    tiny_model: Path, tiny_adapters: AdapterFactory
) -> None:
    folders = tiny_adapters(2, "flops", ranks=(4, 8), all_projections=True)
    folder = next(iter(folders.values())).parent
    work = TokenWork.of(tiny_model, folder, sorted(folders))
    weights = load_file(str(tiny_model / "model.safetensors"))
    config = json.loads((tiny_model / "config.json").read_text())
    projections = sum(t.numel() for n, t in weights.items() if n.endswith("_proj.weight"))
    head = config["hidden_size"] * config["vocab_size"]  # the LM head, tied or not
    assert work.flops(0) == 2 * (projections + head)
    # attention: a score and a weighted sum per query head, position and width, every layer
    per_position = 2 * 2 * config["num_hidden_layers"] * config["hidden_size"]
    assert work.flops(100) - work.flops(0) == pytest.approx(100 * per_position)
    for name, path in folders.items():
        tensors = load_file(str(path / "adapter_model.safetensors"))
        lora = sum(t.numel() for n, t in tensors.items() if "lora_" in n)
        assert work.flops(0, name) - work.flops(0) == 2 * lora
    assert work.flops(0, "unknown") == work.flops(0)


def test_a_traces_flops_weigh_each_request_by_its_tokens(
    tiny_model: Path, tiny_adapters: AdapterFactory
) -> None:
    folders = tiny_adapters(1, "trace-flops", ranks=(8,))
    (name,) = folders
    ceiling = Ceiling.of(tiny_model, folders[name].parent, [name], "float32")
    trace = [
        TraceRequest("a", 0.0, "t0", name, "Tell me a story.", 30),
        TraceRequest("b", 0.0, "t0", None, "Hi.", 10),
    ]
    prompts = [ceiling.count_tokens(r.prompt) for r in trace]
    assert all(n > 0 for n in prompts)
    work = ceiling.work
    expected = (30 * work.flops(prompts[0] + 15, name) + 10 * work.flops(prompts[1] + 5)) / 40
    assert ceiling.flops(trace) == pytest.approx(expected)
    assert ceiling.machine_gflops() > 0


def test_the_share_of_the_machine_is_flops_a_second_over_its_rate() -> None:
    assert machine_share(100.0, 3e8, 60.0) == pytest.approx(0.5)
    assert machine_share(100.0, 3e8, None) is None
