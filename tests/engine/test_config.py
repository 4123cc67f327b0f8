"""Engine settings: memory sizes, devices and dtypes are read as a user writes them."""

from __future__ import annotations

import pytest
import torch

from lora_guard.engine.config import EngineConfig
from lora_guard.engine.values import ConfigError, parse_memory


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("512MiB", 512 * 2**20),
        ("2GB", 2 * 10**9),
        ("1.5 GiB", 3 * 2**29),
        ("4096", 4096),
        (1024, 1024),
        ("64kib", 64 * 1024),
    ],
)
def test_memory_sizes(text: str | int, size: int) -> None:
    assert parse_memory(text) == size


@pytest.mark.parametrize("text", ["", "12 parsecs", "-5MiB", "0", "MiB"])
def test_bad_memory_sizes_are_clear_errors(text: str) -> None:
    with pytest.raises(ConfigError):
        parse_memory(text)


def test_config_checks_itself() -> None:
    config = EngineConfig(model="m", kv_cache_memory="1MiB", dtype="float32", device="cpu")
    assert config.kv_cache_memory == 2**20 and config.torch_dtype is torch.float32
    with pytest.raises(ConfigError, match="block_size"):
        EngineConfig(model="m", block_size=12, device="cpu")
    with pytest.raises(ConfigError, match="max_cpu_loras"):
        EngineConfig(model="m", max_loras=8, max_cpu_loras=4, device="cpu")
    with pytest.raises(ConfigError, match="dtype"):
        EngineConfig(model="m", dtype="int8", device="cpu")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="CUDA"):
            EngineConfig(model="m", device="cuda")


def test_each_field_is_checked_as_its_flag_is() -> None:
    config = EngineConfig(model="m", dtype="bf16", device="CPU", lora_compute="Batched")
    assert config.torch_dtype is torch.bfloat16 and config.lora_compute == "batched"
    with pytest.raises(ConfigError, match="max_loras: must be at least 0"):
        EngineConfig(model="m", max_loras=-1, device="cpu")
    with pytest.raises(ConfigError, match="lora_compute: expected one of auto, kernel, loop, bat"):
        EngineConfig(model="m", lora_compute="fused", device="cpu")
    with pytest.raises(ConfigError, match="max_batch_tokens must be at least block_size"):
        EngineConfig(model="m", block_size=32, max_batch_tokens=16, device="cpu")


def test_max_cpu_loras_left_at_its_default_follows_max_loras() -> None:
    assert EngineConfig(model="m", max_loras=64, device="cpu").max_cpu_loras == 64
    assert EngineConfig(model="m", max_loras=4, device="cpu").max_cpu_loras == 32
    assert EngineConfig(model="m", max_loras=4, max_cpu_loras=4, device="cpu").max_cpu_loras == 4


def test_adapter_pages_take_the_models_dtype_unless_told() -> None:
    assert EngineConfig(model="m", device="cpu").torch_lora_dtype is torch.float32
    config = EngineConfig(model="m", dtype="bf16", device="cpu")
    assert config.torch_lora_dtype is torch.bfloat16
    config = EngineConfig(model="m", dtype="float32", lora_dtype="bf16", device="cpu")
    assert (config.torch_dtype, config.torch_lora_dtype) == (torch.float32, torch.bfloat16)
    with pytest.raises(ConfigError, match="lora_dtype: expected one of"):
        EngineConfig(model="m", lora_dtype="int4", device="cpu")
