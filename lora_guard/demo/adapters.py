"""Make seeded, real PEFT LoRA adapters for a Llama-family checkpoint (tests, demos, benchmarks).

Adapters vary in rank, in target modules (attention only, or attention and MLP) and in scaling
(``lora_alpha = 2 * r``, rsLoRA on every third), and are written with PEFT's ``save_pretrained``.
PEFT's ``init_lora_weights=False`` draws both A and B at random; B is then rescaled so that each
module's update ``scale * B @ A`` has ``strength`` times the Frobenius norm of the base weight,
which keeps the adapted model fluent while clearly changing its outputs.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
ADAPTERS_INDEX = "adapters.json"


class AdapterMakerError(RuntimeError):
    """The base checkpoint or the requested adapters are not usable."""


@dataclass(frozen=True)
class AdapterSpec:
    name: str
    rank: int
    alpha: int
    target_modules: tuple[str, ...]
    use_rslora: bool
    seed: int

    @property
    def scale(self) -> float:
        return self.alpha / (self.rank**0.5 if self.use_rslora else self.rank)


def plan_adapters(
    n: int,
    ranks: Sequence[int],
    seed: int = 0,
    prefix: str = "adapter",
    all_projections: bool = False,
) -> list[AdapterSpec]:
    """Adapter i takes rank ``ranks[i % len(ranks)]``; target sets alternate per rank cycle
    (attention only, then attention and MLP), or are every projection with ``all_projections``."""
    if n < 1:
        raise AdapterMakerError(f"--n must be at least 1, got {n}")
    if not ranks or any(r < 1 for r in ranks):
        raise AdapterMakerError(f"--ranks must be positive integers, got {list(ranks)}")
    specs = []
    for i in range(n):
        rank = ranks[i % len(ranks)]
        with_mlp = all_projections or (i // len(ranks)) % 2 == 1
        specs.append(
            AdapterSpec(
                name=f"{prefix}-{i:02d}",
                rank=rank,
                alpha=2 * rank,
                target_modules=ATTENTION_MODULES + (MLP_MODULES if with_mlp else ()),
                use_rslora=i % 3 == 2,
                seed=seed * 100_003 + i,
            )
        )
    return specs


def make_adapters(
    base: Path,
    out: Path,
    *,
    n: int = 24,
    ranks: Sequence[int] = (8, 16, 32, 64),
    seed: int = 0,
    prefix: str = "adapter",
    strength: float = 0.1,
    all_projections: bool = False,
    log: Callable[[str], None] = lambda _msg: None,
) -> list[Path]:
    """Write ``n`` PEFT adapters for the checkpoint in ``base`` into ``out/<name>/``.

    Also writes ``out/adapters.json`` describing them. Returns the adapter folders.
    """
    specs = plan_adapters(n, ranks, seed, prefix, all_projections)
    return write_adapters(base, out, specs, strength=strength, log=log)


def named_specs(ranks: dict[str, int], seed: int = 0) -> list[AdapterSpec]:
    """Specs for adapters of the given names and ranks, targets alternating as
    :func:`plan_adapters` does (attention only, then attention and MLP)."""
    specs = []
    for i, (name, rank) in enumerate(ranks.items()):
        if rank < 1:
            raise AdapterMakerError(f"adapter {name!r}: rank must be positive, got {rank}")
        mlp = MLP_MODULES if i % 2 else ()
        specs.append(
            AdapterSpec(
                name, rank, 2 * rank, ATTENTION_MODULES + mlp, i % 3 == 2, seed * 100_003 + i
            )
        )
    return specs


def write_adapters(
    base: Path,
    out: Path,
    specs: Sequence[AdapterSpec],
    *,
    strength: float = 0.1,
    log: Callable[[str], None] = lambda _msg: None,
) -> list[Path]:
    """Write the adapters ``specs`` describe for the checkpoint in ``base`` into
    ``out/<name>/``, and ``out/adapters.json``. Returns the adapter folders."""
    if not (base / "config.json").is_file():
        raise AdapterMakerError(f"{base} is not a Hugging Face checkpoint (no config.json)")

    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    present = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    missing = sorted(set(ATTENTION_MODULES + MLP_MODULES) - present)
    if missing:
        raise AdapterMakerError(
            f"{base} is not a Llama-family model: it has no {', '.join(missing)} modules"
        )

    out.mkdir(parents=True, exist_ok=True)
    folders, index = [], []
    for spec in specs:
        config = LoraConfig(
            r=spec.rank,
            lora_alpha=spec.alpha,
            target_modules=list(spec.target_modules),
            use_rslora=spec.use_rslora,
            lora_dropout=0.0,
            init_lora_weights=False,
            task_type="CAUSAL_LM",
        )
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(spec.seed)
            peft_model = get_peft_model(model, config)
        _rescale_updates(peft_model, spec.scale, strength)
        folder = out / spec.name
        if folder.exists():
            shutil.rmtree(folder)
        peft_model.save_pretrained(str(folder))
        model = peft_model.unload()
        size = sum(p.stat().st_size for p in folder.iterdir())
        index.append({**asdict(spec), "bytes": size})
        folders.append(folder)
        log(
            f"  {spec.name}: r={spec.rank} alpha={spec.alpha} rslora={spec.use_rslora} "
            f"targets={','.join(spec.target_modules)} ({size / 1e6:.1f} MB)"
        )
    (out / ADAPTERS_INDEX).write_text(json.dumps({"adapters": index}, indent=2) + "\n")
    return folders


def _rescale_updates(peft_model: Any, scale: float, strength: float) -> None:
    """Scale each lora_B so that ``||scale * B @ A|| == strength * ||W||`` for its module."""
    import torch
    from peft.tuners.lora import LoraLayer

    with torch.no_grad():
        for module in peft_model.modules():
            if not isinstance(module, LoraLayer):
                continue
            a = module.lora_A["default"].weight
            b = module.lora_B["default"].weight
            delta_norm = (scale * b @ a).norm()
            target = strength * module.get_base_layer().weight.norm()
            b.mul_(target / delta_norm)
