"""``lora-guard serve-ray``: the command starts Ray, two replicas and the ingress on a loopback
port, answers every adapter with the engine's tokens, and stops on SIGTERM with status 0."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from lora_guard.testing import free_port

pytest.importorskip("ray", reason="needs lora-guard[ray]")


def command(*args: str) -> list[str]:
    return [sys.executable, "-m", "lora_guard.cli", "serve-ray", *args]


def test_the_command_serves_every_adapter_correctly_and_stops_on_sigterm(
    tiny: tuple[Path, Path], serves_correctly: Callable[..., None], tmp_path: Path
) -> None:
    model, adapters = tiny
    port = free_port()
    log = tmp_path / "serve-ray.log"
    environment = {**os.environ, "LORA_GUARD_DISABLE_PLUGIN_AUTOLOAD": "1"}
    args = command(
        "--replicas", "2", "--replica-cpus", "0.5", "--ray-cpus", "2", "--model", str(model),
        "--adapter-dir", str(adapters), "--host", "127.0.0.1", "--port", str(port),
        "--kv-cache-memory", "16MiB", "--block-size", "4",
    )  # fmt: skip
    with log.open("w") as out:
        process = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=environment)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and process.poll() is None:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        assert process.poll() is None, log.read_text()[-3000:]
        serves_correctly(url)
    finally:
        process.send_signal(signal.SIGTERM)
        status = process.wait(120)
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
