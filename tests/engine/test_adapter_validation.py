"""Reading PEFT adapter folders: every refusal names the adapter and the reason, good adapters
parse with the right per-module rank and folded scale, and a bad adapter fails only its own
requests inside the engine."""

from __future__ import annotations

import copy
import json
import logging
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from peft.tuners.lora import LoraLayer
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM

from lora_guard import LLM, SamplingParams
from lora_guard.demo.adapters import make_adapters
from lora_guard.demo.testing import make_tiny_llama
from lora_guard.engine import RequestError
from lora_guard.engine.lora import AdapterError, LoRAAdapter, read_adapter
from lora_guard.engine.lora.checkpoint import largest_adapter_bytes
from lora_guard.engine.spec import ModelSpec

ALL_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
WEIGHTS = "adapter_model.safetensors"
CONFIG = "adapter_config.json"
MAX_RANK = 8
PROMPTS = ["The capital of France is", "A LoRA adapter changes", "The quick brown fox"]
PARAMS = SamplingParams(max_new_tokens=5, ignore_eos=True)


@pytest.fixture(scope="module")
def base(tiny_model: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def spec(tiny_model: Path) -> ModelSpec:
    return ModelSpec.from_config(AutoConfig.from_pretrained(tiny_model))


def peft_lora(base: torch.nn.Module, seed: int = 0, **options: Any) -> Any:
    """A PEFT model with random (non-zero) A and B over a copy of ``base``."""
    settings: dict[str, Any] = {
        "r": 4,
        "lora_alpha": 8,
        "target_modules": ["q_proj", "v_proj"],
        "lora_dropout": 0.0,
        "init_lora_weights": False,
        "task_type": "CAUSAL_LM",
    }
    settings.update(options)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return get_peft_model(copy.deepcopy(base), LoraConfig(**settings))


def save_lora(
    base: torch.nn.Module, out: Path, seed: int = 0, safe: bool = True, **options: Any
) -> Path:
    peft_lora(base, seed, **options).save_pretrained(str(out), safe_serialization=safe)
    return out


def refusal(adapter_id: str, path: Path, spec: ModelSpec, max_rank: int = MAX_RANK) -> str:
    with pytest.raises(AdapterError) as info:
        read_adapter(adapter_id, path, spec, max_rank)
    message = str(info.value)
    assert f"'{adapter_id}'" in message, f"the error does not name the adapter: {message}"
    return message


def lora_modules(peft_model: Any) -> dict[tuple[int, str], LoraLayer]:
    """(layer, module name) -> PEFT LoRA layer."""
    found = {}
    for name, module in peft_model.named_modules():
        if isinstance(module, LoraLayer):
            parts = name.split(".")
            found[int(parts[parts.index("layers") + 1]), parts[-1]] = module
    return found


# refusals


def test_dora_is_refused(base: torch.nn.Module, spec: ModelSpec, tmp_path: Path) -> None:
    path = save_lora(base, tmp_path / "dora", use_dora=True)
    assert "DoRA" in refusal("dora-1", path, spec)


@pytest.mark.filterwarnings("ignore:.*tie_word_embeddings:UserWarning")
def test_modules_to_save_is_refused(base: torch.nn.Module, spec: ModelSpec, tmp_path: Path) -> None:
    path = save_lora(base, tmp_path / "mts", modules_to_save=["lm_head"])
    assert "modules_to_save" in refusal("mts", path, spec)


def test_pickle_bin_alone_is_refused(
    base: torch.nn.Module, spec: ModelSpec, tmp_path: Path
) -> None:
    path = save_lora(base, tmp_path / "bin", safe=False)
    assert (path / "adapter_model.bin").is_file() and not (path / WEIGHTS).exists()
    message = refusal("pickled", path, spec)
    assert "pickle" in message and "adapter_model.bin" in message


def test_pickle_beside_safetensors_is_never_opened(
    base: torch.nn.Module, spec: ModelSpec, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Many adapter repositories ship both files; the safetensors one is read, the pickle left
    # shut. An audit hook sees every open() of this process: the pickle's path never shows up.
    path = save_lora(base, tmp_path / "both")
    pickle = path / "adapter_model.bin"
    torch.save(load_file(path / WEIGHTS), pickle)
    opened: list[str] = []
    watching = True

    def audit(event: str, args: tuple[Any, ...]) -> None:
        if watching and event == "open" and args and isinstance(args[0], str | bytes | Path):
            opened.append(os.fsdecode(args[0]))

    sys.addaudithook(audit)
    try:
        with caplog.at_level(logging.INFO, logger="lora_guard.engine.lora.checkpoint"):
            adapter = read_adapter("both", path, spec, MAX_RANK)
            read_adapter("both", path, spec, MAX_RANK)
    finally:
        watching = False
    assert adapter.weights and str(path / WEIGHTS) in {str(Path(p).resolve()) for p in opened}
    assert not [p for p in opened if Path(p).name == pickle.name], opened
    said = [r.getMessage() for r in caplog.records if "adapter_model.bin" in r.getMessage()]
    assert len(said) == 1 and "never read" in said[0]  # said once, not at every read


def test_only_regular_files_are_read(
    base: torch.nn.Module, spec: ModelSpec, tmp_path: Path
) -> None:
    path = save_lora(base, tmp_path / "odd")
    (path / WEIGHTS).unlink()
    os.mkfifo(path / WEIGHTS)  # reading it would block for good
    assert f"{WEIGHTS} is not a regular file" in refusal("odd", path, spec)
    (path / WEIGHTS).unlink()
    (path / WEIGHTS).mkdir()
    assert f"{WEIGHTS} is not a regular file" in refusal("odd", path, spec)


def test_files_must_resolve_inside_the_adapter_directory(
    base: torch.nn.Module, spec: ModelSpec, tmp_path: Path
) -> None:
    root, elsewhere = tmp_path / "adapters", save_lora(base, tmp_path / "elsewhere")
    path = save_lora(base, root / "linked")
    (path / WEIGHTS).unlink()
    (path / WEIGHTS).symlink_to(elsewhere / WEIGHTS)
    assert read_adapter("linked", path, spec, MAX_RANK).rank == 4  # no root: as named
    with pytest.raises(AdapterError, match="leads outside the adapter directory"):
        read_adapter("linked", path, spec, MAX_RANK, root=root)
    (root / "folder-link").symlink_to(elsewhere)
    with pytest.raises(AdapterError, match="leads outside the adapter directory"):
        read_adapter("folder-link", root / "folder-link", spec, MAX_RANK, root=root)


def test_rank_above_max_rank_is_refused(
    base: torch.nn.Module, spec: ModelSpec, tmp_path: Path
) -> None:
    path = save_lora(base, tmp_path / "r16", r=16, lora_alpha=16)
    message = refusal("big", path, spec, max_rank=8)
    assert "rank 16" in message and "8" in message
    # the same folder is fine where the limit allows it
    assert read_adapter("big", path, spec, 16).rank == 16


def test_adapter_for_another_hidden_size_is_refused(
    spec: ModelSpec, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    other_dir = make_tiny_llama(
        tmp_path_factory.mktemp("hidden32"), hidden_size=32, intermediate_size=64
    )
    other = AutoModelForCausalLM.from_pretrained(other_dir, dtype=torch.float32)
    path = save_lora(other, tmp_path / "h32")
    message = refusal("elsewhere", path, spec)
    assert "do not fit the base model" in message
    assert "32" in message and "64" in message


def test_files_larger_than_any_adapter_of_the_model_are_refused_unread(
    base: torch.nn.Module, spec: ModelSpec, tmp_path: Path
) -> None:
    # The largest valid adapter (every projection at the rank limit, in float64) fits the cap.
    biggest = save_lora(base, tmp_path / "biggest", r=MAX_RANK, target_modules=ALL_MODULES)
    cap = largest_adapter_bytes(spec, MAX_RANK)
    assert (biggest / WEIGHTS).stat().st_size * 2 < cap
    assert read_adapter("biggest", biggest, spec, MAX_RANK).weights
    # A file past the cap is refused from its size; a sparse one costs no disk to make.
    path = save_lora(base, tmp_path / "huge")
    with (path / WEIGHTS).open("r+b") as handle:
        handle.truncate(cap + 1)
    message = refusal("huge", path, spec)
    assert f"{WEIGHTS} is {cap + 1:,} bytes" in message and "was not read" in message
    path = save_lora(base, tmp_path / "huge-config")
    config = path / "adapter_config.json"
    config.write_text(config.read_text() + " " * 2**20)  # still valid JSON, but no config is 1 MiB
    assert "adapter_config.json is" in refusal("huge-config", path, spec)


@pytest.mark.parametrize(
    "damage",
    [
        pytest.param(lambda data: data[: len(data) // 2], id="truncated"),
        pytest.param(lambda data: data[:8] + b"\xff" * (len(data) - 8), id="garbage"),
        pytest.param(lambda data: b"", id="empty"),
    ],
)
def test_corrupt_safetensors_is_refused(
    base: torch.nn.Module,
    spec: ModelSpec,
    tmp_path: Path,
    damage: Callable[[bytes], bytes],
) -> None:
    path = save_lora(base, tmp_path / "corrupt")
    weights = path / WEIGHTS
    weights.write_bytes(damage(weights.read_bytes()))
    message = refusal("broken", path, spec)
    assert "corrupt or truncated" in message and WEIGHTS in message


def test_missing_config_is_refused(base: torch.nn.Module, spec: ModelSpec, tmp_path: Path) -> None:
    path = save_lora(base, tmp_path / "noconfig")
    (path / CONFIG).unlink()
    message = refusal("headless", path, spec)
    assert "missing" in message and CONFIG in message


def test_missing_weights_are_refused(
    base: torch.nn.Module, spec: ModelSpec, tmp_path: Path
) -> None:
    path = save_lora(base, tmp_path / "noweights")
    (path / WEIGHTS).unlink()
    message = refusal("empty", path, spec)
    assert "missing" in message and WEIGHTS in message


def test_invalid_json_config_is_refused(
    base: torch.nn.Module, spec: ModelSpec, tmp_path: Path
) -> None:
    path = save_lora(base, tmp_path / "badjson")
    (path / CONFIG).write_text('{"r": 4, "lora_alpha": ')
    message = refusal("garbled", path, spec)
    assert "not valid JSON" in message and CONFIG in message


@pytest.mark.filterwarnings("ignore:.*(tie_word_embeddings|save_embedding_layers):UserWarning")
@pytest.mark.parametrize("target", ["embed_tokens", "lm_head"])
def test_unsupported_target_module_is_refused(
    base: torch.nn.Module, spec: ModelSpec, tmp_path: Path, target: str
) -> None:
    path = save_lora(base, tmp_path / target, target_modules=["q_proj", target])
    message = refusal(f"with-{target}", path, spec)
    assert target in message and "not a LoRA A/B weight of a supported projection" in message


def test_path_that_is_not_a_folder_is_refused(spec: ModelSpec, tmp_path: Path) -> None:
    message = refusal("ghost", tmp_path / "does-not-exist", spec)
    assert "not a folder" in message


# adapters that parse


def assert_folded(adapter: LoRAAdapter, peft_model: Any, expected: dict[str, float]) -> None:
    """Each module's A is PEFT's A; its stored B is PEFT's B times PEFT's own scaling."""
    modules = lora_modules(peft_model)
    assert set(adapter.weights) == set(modules)
    for (layer, name), module in modules.items():
        a, b = adapter.weights[layer, name]
        peft_a = module.lora_A["default"].weight.detach()
        peft_b = module.lora_B["default"].weight.detach()
        scale = module.scaling["default"]
        assert scale == pytest.approx(expected[name]), (layer, name)
        assert a.shape[0] == peft_a.shape[0] == module.r["default"]
        torch.testing.assert_close(a, peft_a)
        torch.testing.assert_close(b, peft_b * scale)


def test_rank_and_alpha_patterns(base: torch.nn.Module, spec: ModelSpec, tmp_path: Path) -> None:
    peft_model = peft_lora(
        base,
        r=4,
        lora_alpha=8,
        target_modules=["q_proj", "k_proj", "v_proj", "down_proj"],
        rank_pattern={"q_proj": 8, "down_proj": 2},
        alpha_pattern={"v_proj": 32, "down_proj": 1},
    )
    path = tmp_path / "patterns"
    peft_model.save_pretrained(str(path))
    adapter = read_adapter("patterned", path, spec, MAX_RANK)
    assert adapter.rank == 8
    assert adapter.target_modules == ("down_proj", "k_proj", "q_proj", "v_proj")
    ranks = {name: a.shape[0] for (_, name), (a, _) in adapter.weights.items()}
    assert ranks == {"q_proj": 8, "k_proj": 4, "v_proj": 4, "down_proj": 2}
    # q: 8/8, k: 8/4 (default alpha), v: 32/4 (alpha_pattern), down: 1/2 (both patterns)
    assert_folded(
        adapter, peft_model, {"q_proj": 1.0, "k_proj": 2.0, "v_proj": 8.0, "down_proj": 0.5}
    )


def test_alpha_pattern_regex_is_matched_as_peft_matches_it(
    base: torch.nn.Module, spec: ModelSpec, tmp_path: Path
) -> None:
    # PEFT documents the pattern keys as regular expressions; it matches each one as a whole
    # against the end of the module name, so an alternation covers both projections.
    peft_model = peft_lora(
        base,
        r=4,
        lora_alpha=8,
        target_modules=["q_proj", "k_proj", "v_proj"],
        alpha_pattern={"q_proj|v_proj": 32},
    )
    path = tmp_path / "alternation"
    peft_model.save_pretrained(str(path))
    adapter = read_adapter("alt", path, spec, MAX_RANK)
    assert_folded(adapter, peft_model, {"q_proj": 8.0, "k_proj": 2.0, "v_proj": 8.0})


def test_per_layer_alpha_pattern(base: torch.nn.Module, spec: ModelSpec, tmp_path: Path) -> None:
    peft_model = peft_lora(
        base,
        r=4,
        lora_alpha=8,
        target_modules=["q_proj", "v_proj"],
        alpha_pattern={"model.layers.1.self_attn.v_proj": 2},
    )
    path = tmp_path / "per-layer"
    peft_model.save_pretrained(str(path))
    adapter = read_adapter("layered", path, spec, MAX_RANK)
    modules = lora_modules(peft_model)
    assert modules[1, "v_proj"].scaling["default"] == 0.5
    assert modules[0, "v_proj"].scaling["default"] == 2.0
    for key, module in modules.items():
        _, b = adapter.weights[key]
        torch.testing.assert_close(
            b, module.lora_B["default"].weight.detach() * module.scaling["default"]
        )


def test_rslora_scales_by_alpha_over_sqrt_rank(
    base: torch.nn.Module, spec: ModelSpec, tmp_path: Path
) -> None:
    peft_model = peft_lora(base, r=4, lora_alpha=8, use_rslora=True, target_modules=ALL_MODULES)
    path = tmp_path / "rslora"
    peft_model.save_pretrained(str(path))
    adapter = read_adapter("rs", path, spec, MAX_RANK)
    assert adapter.rank == 4
    assert_folded(adapter, peft_model, dict.fromkeys(ALL_MODULES, 8 / 4**0.5))


def test_content_hash_follows_the_files(
    base: torch.nn.Module, spec: ModelSpec, tmp_path: Path
) -> None:
    first = save_lora(base, tmp_path / "first", seed=1)
    again = save_lora(base, tmp_path / "again", seed=1)
    copied = tmp_path / "copied"
    shutil.copytree(first, copied)
    h = read_adapter("x", first, spec, MAX_RANK).content_hash
    assert read_adapter("x", first, spec, MAX_RANK).content_hash == h
    assert read_adapter("y", copied, spec, MAX_RANK).content_hash == h
    assert read_adapter("z", again, spec, MAX_RANK).content_hash == h

    other_seed = save_lora(base, tmp_path / "other", seed=2)
    assert read_adapter("x", other_seed, spec, MAX_RANK).content_hash != h

    # one weight changed in place, same config and same tensor names
    tensors = load_file(copied / WEIGHTS)
    key = sorted(tensors)[0]
    tensors[key] = tensors[key].clone()
    tensors[key][0, 0] += 1.0
    save_file(tensors, copied / WEIGHTS, metadata={"format": "pt"})
    assert read_adapter("y", copied, spec, MAX_RANK).content_hash != h

    # a config change alone (the scale) also changes it
    changed_alpha = tmp_path / "alpha"
    shutil.copytree(first, changed_alpha)
    config = json.loads((changed_alpha / CONFIG).read_text())
    config["lora_alpha"] = 16
    (changed_alpha / CONFIG).write_text(json.dumps(config))
    assert read_adapter("x", changed_alpha, spec, MAX_RANK).content_hash != h


# through the engine


def make_bad(kind: str, base: torch.nn.Module, out: Path) -> Path:
    if kind == "dora":
        return save_lora(base, out, use_dora=True)
    if kind == "rank":
        return save_lora(base, out, r=16, lora_alpha=16)
    path = save_lora(base, out)
    weights = path / WEIGHTS
    weights.write_bytes(weights.read_bytes()[:100])
    return path


@pytest.fixture(scope="module")
def good_adapter(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("good")
    return make_adapters(tiny_model, out, n=2, ranks=(4,), strength=0.5)[1]  # attention + MLP


@pytest.fixture(scope="module")
def expected_tokens(
    tiny_model: Path, base: torch.nn.Module, good_adapter: Path
) -> dict[str | None, list[list[int]]]:
    """Greedy tokens of transformers (base) and PEFT (good adapter) for PROMPTS."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    adapted = PeftModel.from_pretrained(copy.deepcopy(base), good_adapter).eval()
    expected: dict[str | None, list[list[int]]] = {None: [], "good": []}
    for prompt in PROMPTS:
        ids = torch.tensor([tokenizer.encode(prompt)])
        for key, model in ((None, base), ("good", adapted)):
            out = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=PARAMS.max_new_tokens,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
            expected[key].append(out[0, ids.shape[1] :].tolist())
    return expected


@pytest.mark.parametrize(
    ("kind", "reason"),
    [
        ("dora", "DoRA adapters are not supported"),
        ("rank", "rank 16 exceeds max_lora_rank 8"),
        ("corrupt", "corrupt or truncated"),
    ],
)
def test_bad_adapter_fails_only_its_own_requests(
    tiny_model: Path,
    base: torch.nn.Module,
    good_adapter: Path,
    expected_tokens: dict[str | None, list[list[int]]],
    tmp_path: Path,
    kind: str,
    reason: str,
) -> None:
    assert expected_tokens["good"] != expected_tokens[None], "the good adapter must matter"
    bad = make_bad(kind, base, tmp_path / kind)
    llm = LLM(
        tiny_model,
        adapters={"bad": bad, "good": good_adapter},
        kv_cache_memory="4MiB",
        max_loras=2,
        max_lora_rank=MAX_RANK,
        device="cpu",
    )
    try:
        outs = llm.generate(PROMPTS, PARAMS, adapter_ids=["bad", "good", None])
        assert outs[0].finished and outs[0].finish_reason == "error"
        assert outs[0].error is not None
        assert "'bad'" in outs[0].error and reason in outs[0].error
        assert outs[0].token_ids == []
        for out, adapter, i in ((outs[1], "good", 1), (outs[2], None, 2)):
            assert out.finish_reason == "length" and out.error is None
            assert out.token_ids == expected_tokens[adapter][i], adapter
        llm.engine.check_no_leaks()

        # a second try fails again the same way, and the good adapter and base still work
        outs = llm.generate(PROMPTS, PARAMS, adapter_ids=["good", "bad", None])
        assert outs[1].finish_reason == "error" and reason in (outs[1].error or "")
        assert outs[0].token_ids == expected_tokens["good"][0]
        assert outs[2].token_ids == expected_tokens[None][2]
        llm.engine.check_no_leaks()
    finally:
        llm.engine.shutdown()


def test_patterned_and_rslora_adapters_match_peft_in_the_engine(
    tiny_model: Path, base: torch.nn.Module, tmp_path: Path
) -> None:
    """Mixed per-module ranks and scales, side by side in one batch, give PEFT's tokens."""
    from transformers import AutoTokenizer

    options: dict[str, dict[str, Any]] = {
        "patterned": {
            "r": 4,
            "lora_alpha": 8,
            "target_modules": ALL_MODULES,
            "rank_pattern": {"q_proj": 8, "down_proj": 2},
            "alpha_pattern": {"v_proj": 32, "down_proj": 1},
        },
        "rslora": {"r": 8, "lora_alpha": 4, "target_modules": ALL_MODULES, "use_rslora": True},
    }
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    paths, expected = {}, {}
    for i, (name, opts) in enumerate(options.items()):
        model = peft_lora(base, seed=10 + i, **opts)
        with torch.no_grad():  # keep the update moderate, as a trained adapter's would be
            for module in lora_modules(model).values():
                module.lora_B["default"].weight.mul_(0.1)
        paths[name] = tmp_path / name
        model.save_pretrained(str(paths[name]))
        expected[name] = []
        for prompt in PROMPTS:
            ids = torch.tensor([tokenizer.encode(prompt)])
            out = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=PARAMS.max_new_tokens,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
            expected[name].append(out[0, ids.shape[1] :].tolist())
    assert expected["patterned"] != expected["rslora"]
    llm = LLM(tiny_model, adapters=paths, kv_cache_memory="4MiB", max_loras=2, device="cpu")
    try:
        order = ["patterned", "rslora", "patterned"]
        outs = llm.generate(PROMPTS, PARAMS, adapter_ids=order)
        for i, (name, out) in enumerate(zip(order, outs, strict=True)):
            assert out.finish_reason == "length"
            assert out.token_ids == expected[name][i], name
        llm.engine.check_no_leaks()
    finally:
        llm.engine.shutdown()


@pytest.fixture(scope="module")
def plain_llm(tiny_model: Path, good_adapter: Path) -> Any:
    llm = LLM(
        tiny_model,
        adapters={"good": good_adapter},
        kv_cache_memory="4MiB",
        max_loras=2,
        device="cpu",
    )
    yield llm
    llm.engine.shutdown()


def test_unknown_adapter_raises_request_error(plain_llm: Any) -> None:
    with pytest.raises(RequestError, match="'nope'"):
        plain_llm.generate(PROMPTS[0], PARAMS, adapter_ids="nope")
    outs = plain_llm.generate(PROMPTS[:1], PARAMS, adapter_ids=["good"])
    assert outs[0].finish_reason == "length" and len(outs[0].token_ids) == 5
    plain_llm.engine.check_no_leaks()


def test_unknown_adapter_in_a_batch_queues_nothing(
    tiny_model: Path, good_adapter: Path, expected_tokens: dict[str | None, list[list[int]]]
) -> None:
    llm = LLM(
        tiny_model,
        adapters={"good": good_adapter},
        kv_cache_memory="4MiB",
        max_loras=2,
        device="cpu",
    )
    try:
        with pytest.raises(RequestError, match="'nope'"):
            llm.generate(PROMPTS, PARAMS, adapter_ids=[None, "good", "nope"])
        # the rejected batch must leave no request behind to run (or be held) later
        assert not llm.engine.has_unfinished_requests()
        llm.engine.check_no_leaks()
        outs = llm.generate(PROMPTS, PARAMS, adapter_ids=[None, "good", None])
        assert [o.token_ids for o in outs] == [
            expected_tokens[None][0],
            expected_tokens["good"][1],
            expected_tokens[None][2],
        ]
        llm.engine.check_no_leaks()
    finally:
        llm.engine.shutdown()
