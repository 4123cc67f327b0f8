"""One thread per process runs torch's parallel work: the one that steps the engine.

A thread that runs a parallel torch operation gets an OpenMP team of its own. Once a process has
more OpenMP threads than cores, GNU OpenMP stops spinning at its barriers and sleeps, so every
parallel region of the step loop then waits for a thread to wake. On 2 cores a second team (the
adapter loader's, or the one of the thread that built a server's engine) made the engine's steps
about twice as slow and its small LoRA matmuls ten times (docs/engine.md). Every other thread
that touches tensors calls :func:`serial_thread` first.
"""

from __future__ import annotations

import ctypes
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch

T = TypeVar("T")
_OPENMP = re.compile(r"lib(gomp|iomp5|omp)\b[-.\w]*\.so")


def serial_thread() -> None:
    """Run the calling thread's torch operations on it alone; other threads keep their
    settings (OpenMP's thread count is per thread; ``torch.set_num_threads`` is not)."""
    torch.get_num_threads()  # torch sets a thread's OpenMP threads on its first use: let it first
    for library in openmp_libraries():
        ctypes.CDLL(library).omp_set_num_threads(1)


def openmp_libraries() -> list[str]:
    """The OpenMP runtimes this process has loaded (read from /proc: Linux; none elsewhere)."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if ".so" in line}
    except OSError:
        return []
    return sorted(p for p in paths if _OPENMP.match(Path(p).name))


def serially(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` on the calling thread, made serial first (for ``asyncio.to_thread``)."""
    serial_thread()
    return fn(*args)
