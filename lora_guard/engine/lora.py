"""LoRA adapters: reading PEFT folders, the device slot pool, the host tier and the loader thread.

The slot pool preallocates, for every layer and fused projection, one stacked ``A`` [slots, K, in]
and ``B`` [slots, K, out] (B stored transposed, so a slot's used part is one contiguous block) with
``K = sub-modules * max_rank``; loading an adapter is a copy into its slot, never an allocation.
Within a slot, sub-module ``j`` (q, k or v of the fused qkv, say) uses rows ``j*r : j*r + r_j`` of
A and of B, where ``r`` is the adapter's largest rank, so one pair of matmuls serves the whole
fused projection:

    for each slot s with tokens x_s:  y_s += (x_s @ A[s, :K_s].T) @ B[s, :K_s]

The LoRA scaling (``alpha / r``, or ``alpha / sqrt(r)`` for rsLoRA) is folded into B at load time.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load as load_safetensors

from lora_guard.engine.model import FUSED_PROJECTIONS, LORA_TARGETS, ModelSpec

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")
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


def _pattern_value(patterns: dict[str, float], module_name: str, default: float) -> float:
    for pattern, value in patterns.items():
        if re.fullmatch(rf"(.*\.)?({pattern})", module_name):
            return value
    return default


def _read_regular_file(file: Path, root: Path | None) -> bytes:
    """The bytes of ``file``, which must be a regular file (not a pipe, device or folder) and,
    with ``root``, must resolve inside it. Raises ``ValueError`` with the reason."""
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
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError(f"{file.name} is not a regular file")
        with os.fdopen(os.dup(fd), "rb") as handle:
            return handle.read()
    except OSError as exc:
        raise ValueError(f"cannot read {file.name}: {exc.strerror or exc}") from None
    finally:
        os.close(fd)


def read_adapter(
    adapter_id: str, path: Path, spec: ModelSpec, max_rank: int, root: Path | None = None
) -> LoRAAdapter:
    """Read and validate a PEFT LoRA folder. Raises :class:`AdapterError` with the reason.

    With ``root`` (the adapter directory it was found in), the folder and its files must resolve
    inside ``root``: a symlink leading elsewhere is refused, never read.
    """

    def fail(reason: str) -> AdapterError:
        return AdapterError(f"adapter {adapter_id!r}: {reason}")

    if not path.is_dir():
        raise fail(f"{path} is not a folder")
    if root is not None and not path.resolve().is_relative_to(root.resolve()):
        raise fail(f"{path} leads outside the adapter directory")
    pickles = sorted(p.name for p in path.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise fail(
            f"pickle files are refused ({', '.join(pickles)}): they can run code when loaded; "
            "keep only adapter_config.json and adapter_model.safetensors"
        )
    try:
        config_bytes = _read_regular_file(path / CONFIG_FILE, root)
        data = _read_regular_file(path / WEIGHTS_FILE, root)
    except ValueError as exc:
        raise fail(str(exc)) from None
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
    try:
        tensors = load_safetensors(data)
    except Exception as exc:  # safetensors raises its own error types for corrupt files
        raise fail(f"{WEIGHTS_FILE} is corrupt or truncated ({exc})") from None

    alpha = float(config.get("lora_alpha") or config.get("r") or 8)
    alpha_pattern = config.get("alpha_pattern") or {}
    rslora = bool(config.get("use_rslora", False))
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

    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    max_seen = 0
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
        weights[(layer, module)] = (a.float(), b.float() * scale)
        max_seen = max(max_seen, rank)
    digest = hashlib.sha256(config_bytes + b"\0" + data).hexdigest()
    return LoRAAdapter(
        adapter_id=adapter_id,
        path=path,
        rank=max_seen,
        weights=weights,
        content_hash=digest,
        nbytes=len(data),
        target_modules=tuple(sorted({m for _, m in weights})),
    )


class SlotPool:
    """Device-resident stacked LoRA weights for ``num_slots`` adapters (the model's LoraWeights)."""

    def __init__(
        self,
        spec: ModelSpec,
        num_slots: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.spec, self.num_slots, self.max_rank = spec, num_slots, max_rank
        self.a: dict[tuple[int, str], torch.Tensor] = {}
        self.b: dict[tuple[int, str], torch.Tensor] = {}
        self.widths: dict[str, list[int]] = {p: [0] * num_slots for p in FUSED_PROJECTIONS}
        for projection, modules in FUSED_PROJECTIONS.items():
            fan_in = spec.module_shape(modules[0])[0]
            fan_out = sum(spec.module_shape(m)[1] for m in modules)
            k = len(modules) * max_rank
            for layer in range(spec.num_layers):
                self.a[layer, projection] = torch.zeros(
                    num_slots, k, fan_in, dtype=dtype, device=device
                )
                self.b[layer, projection] = torch.zeros(
                    num_slots, k, fan_out, dtype=dtype, device=device
                )

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.a.values(), *self.b.values()))

    def get(self, layer: int, projection: str) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        return self.a[layer, projection], self.b[layer, projection], self.widths[projection]

    def load(self, slot: int, adapter: LoRAAdapter) -> None:
        r = adapter.rank
        for projection, modules in FUSED_PROJECTIONS.items():
            targeted = any(m in adapter.target_modules for m in modules)
            self.widths[projection][slot] = len(modules) * r if targeted else 0
        layers = {layer for layer, _ in self.a}
        for layer in layers:
            for projection in FUSED_PROJECTIONS:
                width = self.widths[projection][slot]
                if width:
                    self.a[layer, projection][slot, :width].zero_()
                    self.b[layer, projection][slot, :width].zero_()
        for (layer, module), (a, b) in adapter.weights.items():
            projection, out0, out1 = self.spec.fused_rows(module)
            j = FUSED_PROJECTIONS[projection].index(module)
            rows = slice(j * r, j * r + a.shape[0])
            self.a[layer, projection][slot, rows].copy_(a)
            self.b[layer, projection][slot, rows, out0:out1].copy_(b.T)

    def clear(self, slot: int) -> None:
        for widths in self.widths.values():
            widths[slot] = 0


class AdapterLoader:
    """Reads adapters from disk on a background thread so the step loop never waits on I/O."""

    def __init__(self, spec: ModelSpec, max_rank: int) -> None:
        self.spec, self.max_rank = spec, max_rank
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lora-guard-loader")
        self.pending: dict[str, Future[LoRAAdapter]] = {}
        self.read_ms: dict[str, float] = {}  # how long each finished read took, queue excluded

    def submit(self, adapter_id: str, path: Path, root: Path | None = None) -> None:
        if adapter_id not in self.pending:
            self.pending[adapter_id] = self._pool.submit(self._read, adapter_id, path, root)

    def _read(self, adapter_id: str, path: Path, root: Path | None) -> LoRAAdapter:
        started = time.perf_counter()
        try:
            return read_adapter(adapter_id, path, self.spec, self.max_rank, root)
        finally:
            self.read_ms[adapter_id] = (time.perf_counter() - started) * 1000

    def collect(self) -> list[tuple[str, LoRAAdapter | AdapterError]]:
        """Finished loads since the last call: an adapter, or the error that stopped it."""
        done: list[tuple[str, LoRAAdapter | AdapterError]] = []
        for adapter_id, future in list(self.pending.items()):
            if future.done():
                del self.pending[adapter_id]
                try:
                    done.append((adapter_id, future.result()))
                except AdapterError as exc:
                    done.append((adapter_id, exc))
                except Exception as exc:  # an unexpected failure is still that adapter's error
                    done.append((adapter_id, AdapterError(f"adapter {adapter_id!r}: {exc}")))
        return done

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class HostCache:
    """LRU of adapters in host memory (``max_cpu_loras``)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.entries: OrderedDict[str, LoRAAdapter] = OrderedDict()

    def get(self, adapter_id: str) -> LoRAAdapter | None:
        adapter = self.entries.get(adapter_id)
        if adapter is not None:
            self.entries.move_to_end(adapter_id)
        return adapter

    def put(self, adapter: LoRAAdapter) -> None:
        self.entries[adapter.adapter_id] = adapter
        self.entries.move_to_end(adapter.adapter_id)
        while len(self.entries) > self.capacity:
            self.entries.popitem(last=False)

    def drop(self, adapter_id: str) -> None:
        self.entries.pop(adapter_id, None)
