"""Reading a PEFT LoRA folder (``adapter_config.json`` + ``adapter_model.safetensors``) into host
memory, checked against the base model. Pickle files are never opened.

The LoRA scaling (``alpha / r``, or ``alpha / sqrt(r)`` for rsLoRA) is folded into B here.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import stat
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load as load_safetensors

from lora_guard.engine.spec import FUSED_PROJECTIONS, LORA_TARGETS, ModelSpec

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")
MAX_CONFIG_BYTES = 2**20  # an adapter_config.json is a few kB
log = logging.getLogger(__name__)
_pickles_reported: set[Path] = set()
_KEY = re.compile(
    r"^base_model\.model\.model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$"
)


class AdapterError(ValueError):
    """An adapter cannot be used; the message names the adapter and the reason."""


@dataclass(slots=True)
class LoRAAdapter:
    """An adapter read from disk and checked against the base model, held in host memory."""

    adapter_id: str
    path: Path
    rank: int  # the largest rank over its modules
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]  # (layer, module) -> A, sB
    content_hash: str
    nbytes: int
    target_modules: tuple[str, ...] = field(default=())
    stamp: tuple[int, ...] | None = None  # its files' sizes and times when read (files_stamp)


def _pattern_value(patterns: dict[str, float], module_name: str, default: float) -> float:
    for pattern, value in patterns.items():
        if re.fullmatch(rf"(.*\.)?({pattern})", module_name):
            return value
    return default


def files_stamp(path: Path) -> tuple[int, ...] | None:
    """Size and modification time of an adapter folder's config and weights: when it differs
    from the stamp taken at a read, the files have changed since. None if either is missing."""
    try:
        stats = [os.stat(path / name) for name in (CONFIG_FILE, WEIGHTS_FILE)]
    except OSError:
        return None
    return tuple(v for st in stats for v in (st.st_size, st.st_mtime_ns))


def largest_adapter_bytes(spec: ModelSpec, max_rank: int) -> int:
    """The largest weights file a valid adapter can be: rank ``max_rank`` on every projection of
    every layer in float64, plus room for the safetensors header."""
    per_layer = sum(sum(spec.module_shape(m)) for m in LORA_TARGETS)
    return per_layer * spec.num_layers * max_rank * 8 + MAX_CONFIG_BYTES


def config_rank(path: Path) -> int | None:
    """An adapter folder's rank as its ``adapter_config.json`` states it (its largest, where a
    ``rank_pattern`` sets others); None when the file does not say."""
    try:
        config = json.loads((path / CONFIG_FILE).read_text())
        ranks = [config["r"], *(config.get("rank_pattern") or {}).values()]
        return max(int(r) for r in ranks)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def layer_elements(path: Path) -> dict[int, tuple[int, int]]:
    """Elements of an adapter's A and B matrices in each layer, read from its weights file's
    header alone (no tensor is loaded): what sizes its pages before it is read. Empty when the
    file is missing or its header unreadable (the read itself then says why)."""
    try:
        with open(path / WEIGHTS_FILE, "rb") as f:
            length = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(min(length, MAX_CONFIG_BYTES * 16)))
    except (OSError, ValueError):
        return {}
    per_layer: dict[int, tuple[int, int]] = {}
    for key, entry in header.items() if isinstance(header, dict) else ():
        match = _KEY.match(key)
        if match is None or not isinstance(entry, dict):
            continue
        layer, which = int(match.group(1)), match.group(3)
        elems = 1
        for dim in entry.get("shape", ()):
            elems *= int(dim)
        a, b = per_layer.get(layer, (0, 0))
        per_layer[layer] = (a + elems, b) if which == "A" else (a, b + elems)
    return per_layer


def _read_regular_file(file: Path, root: Path | None, limit: int) -> bytes:
    """The bytes of ``file``, which must be a regular file (not a pipe, device or folder) of at
    most ``limit`` bytes and, with ``root``, must resolve inside it. Raises ``ValueError`` with
    the reason; nothing is read from a file that breaks these."""
    try:
        real = file.resolve(strict=True)
    except FileNotFoundError:
        raise ValueError(f"missing {file.name}") from None
    except (OSError, RuntimeError) as exc:  # a symlink loop is a RuntimeError before 3.13
        raise ValueError(f"cannot read {file.name}: {exc}") from None
    if root is not None and not real.is_relative_to(root.resolve()):
        raise ValueError(f"{file.name} leads outside the adapter directory")
    try:
        # O_NONBLOCK: opening a pipe must not wait for a writer; only regular files are read.
        fd = os.open(real, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
    except OSError as exc:
        raise ValueError(f"cannot read {file.name}: {exc.strerror or exc}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ValueError(f"{file.name} is not a regular file")
        if info.st_size > limit:
            raise ValueError(
                f"{file.name} is {info.st_size:,} bytes, more than the {limit:,} any adapter of "
                f"this model up to the rank limit can need; it was not read"
            )
        with os.fdopen(os.dup(fd), "rb") as handle:
            return handle.read()
    except OSError as exc:
        raise ValueError(f"cannot read {file.name}: {exc.strerror or exc}") from None
    finally:
        os.close(fd)


def content_hash(config_bytes: bytes, weights_bytes: bytes) -> str:
    """An adapter's version: sha256 of its config and its weights, as read from its folder."""
    return hashlib.sha256(config_bytes + b"\0" + weights_bytes).hexdigest()


def read_adapter(
    adapter_id: str,
    path: Path,
    spec: ModelSpec,
    max_rank: int,
    root: Path | None = None,
    dtype: torch.dtype = torch.float32,
) -> LoRAAdapter:
    """Read and validate a PEFT LoRA folder. Raises :class:`AdapterError` with the reason.

    The weights come back in ``dtype`` (the engine's ``lora_dtype``), the scaling folded into B
    in float32 first: a 16-bit ``dtype`` rounds them once, here, and every user of the adapter
    (the pool's pages, a merge) then holds the same values.

    With ``root`` (the adapter directory it was found in), the folder and its files must resolve
    inside ``root``: a symlink leading elsewhere is refused, never read.
    """

    def fail(reason: str) -> AdapterError:
        return AdapterError(f"adapter {adapter_id!r}: {reason}")

    _check_folder(adapter_id, path, root, fail)
    stamp = files_stamp(path)  # before reading: a change during the read shows at the next check
    try:
        config_bytes = _read_regular_file(path / CONFIG_FILE, root, MAX_CONFIG_BYTES)
        data = _read_regular_file(path / WEIGHTS_FILE, root, largest_adapter_bytes(spec, max_rank))
    except ValueError as exc:
        raise fail(str(exc)) from None
    config = _read_config(config_bytes, fail)
    try:
        tensors = load_safetensors(data)
    except Exception as exc:  # safetensors raises its own error types for corrupt files
        raise fail(f"{WEIGHTS_FILE} is corrupt or truncated ({exc})") from None
    weights = _scaled(_pairs(tensors, spec, fail), config, spec, max_rank, dtype, fail)
    return LoRAAdapter(
        adapter_id=adapter_id,
        path=path,
        rank=max(a.shape[0] for a, _ in weights.values()),
        weights=weights,
        content_hash=content_hash(config_bytes, data),
        nbytes=len(data),
        target_modules=tuple(sorted({m for _, m in weights})),
        stamp=stamp,
    )


Fail = Callable[[str], AdapterError]


def _check_folder(adapter_id: str, path: Path, root: Path | None, fail: Fail) -> None:
    """A folder inside ``root`` whose weights are safetensors (pickle files beside them are
    left unopened, and said once)."""
    if not path.is_dir():
        raise fail(f"{path} is not a folder")
    if root is not None and not path.resolve().is_relative_to(root.resolve()):
        raise fail(f"{path} leads outside the adapter directory")
    pickles = sorted(p.name for p in path.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles and not (path / WEIGHTS_FILE).exists():
        raise fail(
            f"it holds only pickle weights ({', '.join(pickles)}), which are refused because "
            f"they can run code when loaded; save the adapter with safetensors ({WEIGHTS_FILE})"
        )
    if pickles and path not in _pickles_reported:
        _pickles_reported.add(path)
        log.info(
            "adapter %r: loading %s; %s left unopened (pickle files are never read)",
            adapter_id,
            WEIGHTS_FILE,
            ", ".join(pickles),
        )


def _read_config(config_bytes: bytes, fail: Fail) -> dict[str, Any]:
    """``adapter_config.json`` as a dict, refused when it asks for what the engine cannot do."""
    try:
        config = json.loads(config_bytes)
    except ValueError as exc:
        raise fail(f"{CONFIG_FILE} is not valid JSON ({exc})") from None
    if not isinstance(config, dict):
        raise fail(f"{CONFIG_FILE} is not a JSON object")
    if config.get("peft_type", "LORA") != "LORA":
        raise fail(f"peft_type {config.get('peft_type')!r} is not supported (only LORA)")
    if config.get("use_dora"):
        raise fail("DoRA adapters are not supported")
    if config.get("modules_to_save"):
        raise fail("modules_to_save is not supported (it replaces whole base modules)")
    if config.get("bias", "none") != "none":
        raise fail(f"bias={config.get('bias')!r} is not supported (only 'none')")
    if config.get("fan_in_fan_out"):
        raise fail("fan_in_fan_out adapters are not supported")
    return config


def _pairs(
    tensors: dict[str, torch.Tensor], spec: ModelSpec, fail: Fail
) -> dict[tuple[int, str], dict[str, torch.Tensor]]:
    """The file's tensors by (layer, projection), then ``"A"`` and ``"B"``."""
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.match(key)
        if match is None:
            raise fail(f"tensor {key!r} is not a LoRA A/B weight of a supported projection")
        layer, module, which = int(match.group(1)), match.group(2), match.group(3)
        if module not in LORA_TARGETS:
            raise fail(f"target module {module!r} is not supported ({', '.join(LORA_TARGETS)})")
        if layer >= spec.num_layers:
            raise fail(f"layer {layer} does not exist in the base model ({spec.num_layers} layers)")
        if not tensor.is_floating_point():
            raise fail(f"tensor {key!r} has dtype {tensor.dtype}, expected a float type")
        pairs.setdefault((layer, module), {})[which] = tensor
    if not pairs:
        raise fail("it has no LoRA weights")
    return pairs


def _scaled(
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]],
    config: dict[str, Any],
    spec: ModelSpec,
    max_rank: int,
    dtype: torch.dtype,
    fail: Fail,
) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    """Each projection's (A, B) checked against the base model, the scaling (alpha over rank,
    or over its root with rsLoRA; ``alpha_pattern`` per module) folded into B, in ``dtype``."""
    alpha = float(config.get("lora_alpha") or config.get("r") or 8)
    alpha_pattern = config.get("alpha_pattern") or {}
    rslora = bool(config.get("use_rslora", False))
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    for (layer, module), ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise fail(f"layer {layer} {module} lacks its lora_{'B' if 'A' in ab else 'A'} weight")
        a, b = ab["A"], ab["B"]
        fan_in, fan_out = spec.module_shape(module)
        rank = a.shape[0]
        if a.shape != (rank, fan_in) or b.shape != (fan_out, rank):
            raise fail(
                f"layer {layer} {module}: shapes A{tuple(a.shape)} B{tuple(b.shape)} do not fit "
                f"the base model (expected A({rank}, {fan_in}) B({fan_out}, {rank}))"
            )
        if rank > max_rank:
            raise fail(f"rank {rank} exceeds max_lora_rank {max_rank}")
        block = "mlp" if module in FUSED_PROJECTIONS["gate_up"] + ("down_proj",) else "self_attn"
        name = f"model.layers.{layer}.{block}.{module}"
        module_alpha = _pattern_value(alpha_pattern, name, alpha)
        scale = module_alpha / (rank**0.5 if rslora else rank)
        weights[(layer, module)] = (a.float().to(dtype), (b.float() * scale).to(dtype))
    return weights
