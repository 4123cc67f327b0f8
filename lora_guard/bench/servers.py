"""Starting, watching and stopping a server the bench measures (lora-guard's own, or a peer's).

A :class:`ServerLaunch` is the command and environment; the report keeps both, and the server's
log, so anyone can see how each system ran.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from lora_guard.bench.peer_env import PeerError
from lora_guard.clock import monotonic
from lora_guard.demo.paths import lora_guard_home

_START_TIMEOUT_S = 600


@dataclass(frozen=True)
class ServerLaunch:
    command: list[str]
    environment: dict[str, str]  # what the bench sets, on top of its own environment

    def as_json(self) -> dict[str, Any]:
        """The command and environment as a report shows them: under ``$LORA_GUARD_HOME``, paths
        are written from there (the report is meant to be shared)."""
        return {
            "command": [shared(a) for a in self.command],
            "environment": {k: shared(v) for k, v in self.environment.items()},
        }


def shared(text: str) -> str:
    """``text`` with this machine's paths written as a reader would: ``$LORA_GUARD_HOME``, this
    interpreter as ``python``, the checkout as ``.``, the temporary folder as ``<tmp>``, the home
    folder as ``~``."""
    checkout = Path(__file__).resolve().parents[2]
    for path, name in (
        (lora_guard_home(), "$LORA_GUARD_HOME"),
        (Path(sys.executable), "python"),
        (checkout, "."),
        (Path(tempfile.gettempdir()), "<tmp>"),
        (Path.home(), "~"),
    ):
        text = text.replace(str(path), name)
    return text


@contextmanager
def serving(
    launch: ServerLaunch, port: int, log_file: Path
) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """The server ``launch`` starts, once ready on loopback ``port``, and its URL; stopped on
    leaving."""
    server = start_server(launch, log_file)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_ready(server, url, log_file)
        yield server, url
    finally:
        stop_server(server)


def start_server(launch: ServerLaunch, log_file: Path) -> subprocess.Popen[bytes]:
    """The server started in its own process group, its output in ``log_file``."""
    with log_file.open("wb") as out:
        return subprocess.Popen(
            launch.command,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, **launch.environment},
            start_new_session=True,
        )


def wait_ready(server: subprocess.Popen[bytes], url: str, log_file: Path) -> None:
    """Until ``url``'s /health answers 200; raises :class:`PeerError` with the log's tail if the
    server exits first, or after ``_START_TIMEOUT_S``."""
    deadline = monotonic() + _START_TIMEOUT_S
    while monotonic() < deadline:
        if server.poll() is not None:
            tail = "\n".join(log_file.read_text(errors="replace").splitlines()[-15:])
            raise PeerError(f"the server exited with {server.returncode} while starting:\n{tail}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise PeerError(f"the server was not ready after {_START_TIMEOUT_S} s (log: {log_file})")


def stop_server(server: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the server's process group; SIGKILL after a minute."""
    if server.poll() is None:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()


@contextmanager
def paused(server: subprocess.Popen[bytes]) -> Iterator[None]:
    """The server's process group stopped (SIGSTOP) while inside, continued on leaving: what is
    measured meanwhile gets the whole machine, even beside a server that spins while idle
    (vLLM's CPU worker keeps its cores busy between requests)."""
    os.killpg(server.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.killpg(server.pid, signal.SIGCONT)


def tree_rss(pid: int) -> int:
    """The resident peaks (VmHWM) of ``pid`` and its children, summed (vLLM runs its engine in
    children): at least the tree's true peak, never a sample that missed it."""
    total = 0
    for child in [pid, *_children(pid)]:
        try:
            for line in Path(f"/proc/{child}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    total += int(line.split()[1]) * 1024
        except OSError:
            continue
    return total


def _children(pid: int) -> list[int]:
    found = []
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            text = (task / "children").read_text().split()
            for child in map(int, text):
                found += [child, *_children(child)]
    except OSError:
        pass
    return found
