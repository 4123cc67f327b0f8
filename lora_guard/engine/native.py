"""The engine's compiled CPU operations, one library: the LoRA kernel (``lora/sgmv.cpp``: a
step's LoRA update for one projection in one call) and a decoder layer's small operations
(``layer_ops.cpp``: norms, rotary embedding with the cache write, decode attention, SiLU).

Built on first use with the machine's C++ compiler and ninja (torch's extension builder; about
25 s on two cores, once per torch and Python version) and kept in torch's extension folder
(``$TORCH_EXTENSIONS_DIR``, else ``~/.cache/torch_extensions``); `make bootstrap` builds it ahead.
A build's lock older than ten minutes (a build killed midway) is removed rather than waited on.
Where it cannot be built the engine computes LoRA with the per-segment loop and the layers with
torch's operations, and says why once.
It is built with OpenMP: torch's ``parallel_for`` is an OpenMP pragma in a header, so without
the flag the segments would run one after another. At load the library's ``libgomp.so.1`` is the
one torch has already loaded, so the process keeps one OpenMP runtime (``engine/threads``).
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import torch

from lora_guard.clock import timer, wall

log = logging.getLogger(__name__)

SOURCES = [
    Path(__file__).parent / "lora" / "sgmv.cpp",
    Path(__file__).with_name("layer_ops.cpp"),
    Path(__file__).with_name("row_linear.cpp"),
]
OPS = (
    "lora_apply",
    "rms_norm",
    "add_rms_norm",
    "rope_cache",
    "decode_attention",
    "silu_mul",
    "row_linear",
)
STALE_LOCK_S = 600.0  # a build takes about 25 s here; a lock this old was left by a killed one
_state: dict[str, object] = {}


def _name() -> str:
    tag = torch.__version__.replace(".", "_").replace("+", "_")
    return f"lora_guard_native_torch_{tag}_py{sys.version_info.major}{sys.version_info.minor}"


def load() -> bool:
    """Build (first time) and load the library; False, with :func:`error` saying why, when it
    cannot be had here. Tried once per process."""
    if "ok" not in _state:
        try:
            from torch.utils import cpp_extension

            _clear_stale_lock(Path(cpp_extension._get_build_directory(_name(), verbose=False)))
            cpp_extension.load(
                name=_name(),
                sources=[str(p) for p in SOURCES],
                extra_cflags=["-O3", "-fopenmp"],
                extra_ldflags=["-fopenmp"],
                is_python_module=False,
                verbose=False,
            )
            missing = [op for op in OPS if not hasattr(torch.ops.lora_guard, op)]
            _state["ok"] = not missing
            if missing:
                _state["error"] = f"the built library did not register {', '.join(missing)}"
        except Exception as exc:  # a missing compiler or ninja, a failed build: all mean "no"
            _state["ok"], _state["error"] = False, f"{type(exc).__name__}: {exc}".strip()
        if not _state["ok"]:
            log.warning(
                "compiled operations unavailable, computing with torch's (LoRA per segment): %s",
                error(),
            )
    return bool(_state["ok"])


def _clear_stale_lock(build: Path) -> None:
    """Remove the build's lock when it is older than any build takes: a process killed while it
    built leaves it, and torch's builder then waits for it forever in every later process."""
    lock = build / "lock"
    try:
        age = wall() - lock.stat().st_mtime
    except FileNotFoundError:
        return
    if age > STALE_LOCK_S:
        log.warning("removing %s, left %.0f s ago by a build that did not finish", lock, age)
        lock.unlink(missing_ok=True)


def error() -> str | None:
    """Why the library could not be loaded (None when it was, or was not tried)."""
    reason = _state.get("error")
    return None if reason is None else str(reason).splitlines()[0][:500]


def main() -> int:
    """Build the library ahead (the bootstrap does); 1 when it cannot be built here."""
    started = timer()
    if not load():
        print(f"lora-guard: compiled operations not built: {error()}", file=sys.stderr)
        return 1
    print(f"lora-guard: compiled operations ready ({timer() - started:.1f} s)")
    return 0
