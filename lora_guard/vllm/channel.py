"""What the engine core and the front end of one ``vllm serve`` tell each other, as files in one
folder: the scheduler's view of the adapter seats (for the door's 429), lora-guard's metrics (for
``/metrics``) and the door's rejections (for the cold-load metrics).

vLLM runs its scheduler in an engine-core process that the front end starts, so both find the
folder from the front end's process id; ``LORA_GUARD_VLLM_DIR`` names it instead (needed when
several front ends serve one engine, ``--api-server-count``). The seats and metrics files are
replaced whole (written aside, then renamed), so a reader never sees half of one; the rejections
are lines the door appends and the scheduler takes, emptying the file.
"""

from __future__ import annotations

import fcntl
import json
import multiprocessing
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

DIR_ENV = "LORA_GUARD_VLLM_DIR"
SEATS_FILE = "seats.json"
METRICS_FILE = "metrics.prom"
WANTED_FILE = "metrics.wanted"  # touched by the door when /metrics is read
REJECTS_FILE = "rejects.jsonl"


def channel_dir(front_end_pid: int, environ: Mapping[str, str] = os.environ) -> Path:
    """The folder of the ``vllm serve`` whose front end runs as ``front_end_pid``."""
    given = environ.get(DIR_ENV)
    folder = (
        Path(given) if given else Path(tempfile.gettempdir()) / f"lora-guard-vllm-{front_end_pid}"
    )
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def front_end_pid() -> int:
    """The front end's process id, asked from the engine core: its parent, or itself when vLLM
    runs the engine in-process."""
    return os.getppid() if multiprocessing.parent_process() is not None else os.getpid()


def mtime(path: Path) -> float:
    """``path``'s modification time, 0 when it does not exist."""
    try:
        return path.stat().st_mtime
    except FileNotFoundError:
        return 0.0


def replace_file(path: Path, data: bytes) -> None:
    aside = path.with_name(f".{path.name}.{os.getpid()}")
    aside.write_bytes(data)
    os.replace(aside, path)


class FileWatch:
    """A file read again only when it changed; ``b""`` while it does not exist."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._stamp: tuple[int, int] | None = None
        self._data = b""

    def read(self) -> bytes:
        try:
            stat = self.path.stat()
        except FileNotFoundError:
            return b""
        stamp = (stat.st_mtime_ns, stat.st_size)
        if stamp != self._stamp:
            self._data, self._stamp = self.path.read_bytes(), stamp
        return self._data

    def json(self) -> dict[str, Any]:
        data = self.read()
        return json.loads(data) if data else {}


def take_lines(path: Path) -> list[dict[str, Any]]:
    """The JSON lines appended to ``path`` since the last take; the file is left empty, so it
    never grows past what one step's worth of appends holds. Writer and taker each hold an
    exclusive lock on the file, so every line is taken once, whole, and none is lost."""
    try:
        if path.stat().st_size == 0:  # a stat, not an open, on each of vLLM's steps
            return []
        file = path.open("r+b")
    except FileNotFoundError:
        return []
    with file:
        fcntl.flock(file, fcntl.LOCK_EX)
        data = file.read()
        file.truncate(0)
    return [json.loads(line) for line in data.splitlines() if line.strip()]


def append_line(path: Path, record: Mapping[str, Any]) -> None:
    """One JSON line at the end of ``path``, for :func:`take_lines`."""
    with path.open("ab") as file:
        fcntl.flock(file, fcntl.LOCK_EX)
        file.write(json.dumps(record).encode() + b"\n")
