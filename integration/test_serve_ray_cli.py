"""``lora-guard serve-ray``: the command starts Ray, two replicas and the ingress on a loopback
port, answers every adapter with the engine's tokens, and stops on SIGTERM with status 0."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from lora_guard.demo.testing import start_server

pytest.importorskip("ray", reason="needs lora-guard[ray]")


def command(*args: str) -> list[str]:
    return [sys.executable, "-m", "lora_guard.cli", "serve-ray", *args]


def test_the_command_serves_every_adapter_correctly_and_stops_on_sigterm(
    tiny: tuple[Path, Path], serves_correctly: Callable[..., None], tmp_path: Path
) -> None:
    model, adapters = tiny
    log = tmp_path / "serve-ray.log"
    server = start_server(
        model,
        adapters,
        "--replicas",
        "2",
        "--replica-cpus",
        "0.5",
        "--ray-cpus",
        "2",
        log=log,
        command_name="serve-ray",
        ready_s=240,
    )
    try:
        serves_correctly(server.url)
    finally:
        status = server.stop(timeout=120)
    assert status == 0, log.read_text()[-3000:]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--replicas", "0"), "--replicas must be at least 1"),
        (("--max-loras", "many"), "--max-loras: bad value 'many'"),
    ],
)
def test_bad_arguments_are_refused_before_ray_starts(args: tuple[str, ...], message: str) -> None:
    done = subprocess.run(command(*args), capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert message in done.stderr and "Traceback" not in done.stderr
