"""The checks of an engine setting's value: a value (or a flag's text) in, the value out, a
ValueError saying what is wrong; and the device, dtype and free memory a value resolves to."""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

# torch is imported where a device or a dtype is resolved (the engine being made), not here: the
# command line reads and checks its flags, and the docs' tables are made, without it.
if TYPE_CHECKING:
    import torch


class ConfigError(ValueError):
    """An engine setting is invalid."""


# one row a line, as a table reads (fmt: skip)
_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}  # fmt: skip
#: The dtypes the engine computes in, by name (each is ``torch.<name>``).
DTYPES = ("float32", "bfloat16", "float16")
LORA_DTYPES = ("auto", *DTYPES)  # the names a command-line --lora-dtype takes
# one row a line, as a table reads (fmt: skip)
_DTYPE_NAMES = {
    "auto": "auto",
    "float32": "float32", "fp32": "float32", "float": "float32",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float16": "float16", "fp16": "float16", "half": "float16",
}  # fmt: skip
_DEVICE = re.compile(r"auto|cpu|mps|cuda(:\d+)?")
DEFAULT_CACHE_SHARE = 0.25  # of free memory, when no cache size is given


def at_least(low: int) -> Callable[[Any], int]:
    def check(value: Any) -> int:
        if isinstance(value, str):
            try:
                value = int(value.strip())
            except ValueError:
                raise ValueError("expected an integer") from None
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError("expected an integer")
        if value < low:
            raise ValueError(f"must be at least {low}")
        return value

    check.__name__ = f"at_least_{low}"
    return check


def power_of_two(value: Any) -> int:
    number = at_least(1)(value)
    if number & (number - 1):
        raise ValueError("must be a power of two")
    return number


def one_of(*choices: str) -> Callable[[Any], str]:
    def check(value: Any) -> str:
        word = str(value).strip().lower()
        if word not in choices:
            raise ValueError(f"expected one of {', '.join(choices)}")
        return word

    return check


def text(value: Any) -> str:
    word = str(value).strip()
    if not word:
        raise ValueError("must not be empty")
    return word


def _torch_instance(value: Any, kind: str) -> bool:
    """Whether ``value`` is a ``torch.<kind>`` (``device``, ``dtype``); torch is loaded already
    if it is one, so it is never imported here."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, getattr(torch, kind))


def device_name(value: Any) -> Any:
    if _torch_instance(value, "device"):
        return value
    word = str(value).strip().lower()
    if not _DEVICE.fullmatch(word):
        raise ValueError("expected auto, cpu, cuda, cuda:N or mps")
    return word


def dtype_name(value: Any) -> Any:
    """A dtype, or its name with the aliases read (``bf16`` is ``bfloat16``)."""
    if _torch_instance(value, "dtype"):
        return value
    return _DTYPE_NAMES[one_of(*_DTYPE_NAMES)(value)]


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
    import torch

    if device is None or str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    resolved = torch.device(device)
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device cuda was asked for, but torch sees no CUDA device")
    return resolved


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    import torch

    if dtype is None or dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype):
        if dtype not in [getattr(torch, name) for name in DTYPES]:
            raise ConfigError(f"unsupported dtype {dtype}; use one of {', '.join(DTYPES)}")
        return dtype
    if dtype not in DTYPES:
        raise ConfigError(f"unsupported dtype {dtype!r}; use one of {', '.join(DTYPES)}")
    result: torch.dtype = getattr(torch, dtype)
    return result


def free_memory(device: torch.device) -> int:
    if device.type == "cuda":
        import torch

        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo") as f:
            info = dict(line.split(":", 1) for line in f)
        return int(info["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return 4 * 2**30
