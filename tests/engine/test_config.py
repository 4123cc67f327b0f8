"""Engine settings: memory sizes, devices and dtypes are read as a user writes them."""

from __future__ import annotations

import pytest
import torch

from lora_guard.engine.config import ConfigError, EngineConfig, parse_memory


@pytest.mark.parametrize(
    ("text", "size"),
    [("512MiB", 512 * 2**20), ("2GB", 2 * 10**9), ("1.5 GiB", 3 * 2**29), ("4096", 4096),
     (1024, 1024), ("64kib", 64 * 1024)],
)  # fmt: skip
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
