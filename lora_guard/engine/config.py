"""Engine configuration, validated when it is made."""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}  # fmt: skip
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT_CACHE_SHARE = 0.25  # of free memory, when no cache size is given


class ConfigError(ValueError):
    """An engine setting is invalid."""


def parse_memory(value: int | str) -> int:
    """Bytes from an int or a string such as ``"512MiB"``, ``"2 GB"`` or ``"1048576"``."""
    if isinstance(value, int) and not isinstance(value, bool):
        number = value
    else:
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(value))
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _UNITS:
            raise ConfigError(f"cannot read {value!r} as a memory size (try 512MiB or 2GB)")
        number = int(float(match.group(1)) * _UNITS[unit])
    if number <= 0:
        raise ConfigError(f"memory size must be positive, got {value!r}")
    return number


def resolve_device(device: str | torch.device | None) -> torch.device:
    if device is None or str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    resolved = torch.device(device)
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device cuda was asked for, but torch sees no CUDA device")
    return resolved


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    if dtype is None or dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ConfigError(f"unsupported dtype {dtype}; use one of {', '.join(DTYPES)}")
        return dtype
    if dtype not in DTYPES:
        raise ConfigError(f"unsupported dtype {dtype!r}; use one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


def free_memory(device: torch.device) -> int:
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo") as f:
            info = dict(line.split(":", 1) for line in f)
        return int(info["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return 4 * 2**30


@dataclass(slots=True)
class EngineConfig:
    """Sizes and switches of one engine instance. See ``lora_guard.LLM`` for each field."""

    model: str
    model_id: str | None = None
    max_loras: int = 8
    max_cpu_loras: int = 32
    max_lora_rank: int = 64
    cache_memory: int | str | None = None
    kv_cache_memory: int | str | None = None
    residency_quantum_ms: int = 1000
    lora_compute: str = "loop"
    block_size: int = 16
    enable_prefix_caching: bool = True
    max_batch_tokens: int = 2048
    max_num_seqs: int = 64
    max_model_len: int | None = None
    dtype: str | torch.dtype | None = None
    device: str | torch.device | None = None
    lora_mode: str = "slots"
    static_adapter: str | None = None
    reject_when_busy: bool = True  # False: a policy's "busy" makes a request wait (LLM.generate)

    def __post_init__(self) -> None:
        if self.lora_mode not in ("slots", "merged"):
            raise ConfigError(f"lora_mode must be slots or merged, not {self.lora_mode!r}")
        if self.static_adapter is not None:
            self.lora_mode = "merged"
        if self.max_loras < 1:
            raise ConfigError("max_loras must be at least 1")
        if self.max_cpu_loras < self.max_loras:
            raise ConfigError("max_cpu_loras must be at least max_loras")
        if self.max_lora_rank < 1:
            raise ConfigError("max_lora_rank must be at least 1")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ConfigError("block_size must be a positive power of two")
        if self.max_batch_tokens < self.block_size:
            raise ConfigError("max_batch_tokens must be at least block_size")
        if self.max_num_seqs < 1:
            raise ConfigError("max_num_seqs must be at least 1")
        if self.kv_cache_memory is not None:
            self.kv_cache_memory = parse_memory(self.kv_cache_memory)
        if self.cache_memory is not None:
            self.cache_memory = parse_memory(self.cache_memory)
        if self.residency_quantum_ms < 0:
            raise ConfigError("residency_quantum_ms must be at least 0")
        if self.lora_compute not in ("loop", "batched"):
            raise ConfigError(f"lora_compute must be loop or batched, not {self.lora_compute!r}")
        self.device = resolve_device(self.device)
        self.dtype = resolve_dtype(self.dtype, self.device)

    @property
    def torch_device(self) -> torch.device:
        assert isinstance(self.device, torch.device)
        return self.device

    @property
    def torch_dtype(self) -> torch.dtype:
        assert isinstance(self.dtype, torch.dtype)
        return self.dtype

    def cache_bytes(self) -> int:
        """The cache pool's size: KV blocks and adapter weights share it."""
        for size in (self.cache_memory, self.kv_cache_memory):
            if size is not None:
                return int(size)
        return int(free_memory(self.torch_device) * DEFAULT_CACHE_SHARE)
