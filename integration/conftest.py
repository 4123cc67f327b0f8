"""A real `lora-guard serve` on a free loopback port, with a tiny model and real adapters."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path

import httpx
import pytest

import lora_guard
from lora_guard.bench.peer_env import PEERS
from lora_guard.bench.servers import ServerLaunch, stop_server, wait_ready
from lora_guard.bench.servers import start_server as start_process
from lora_guard.bench.vllm_peer import cpu_list
from lora_guard.demo.adapters import make_adapters
from lora_guard.demo.testing import (
    ServerProcess,
    engine_greedy,
    free_port,
    make_tiny_llama,
    start_server,
)


@pytest.fixture(scope="session")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    model = make_tiny_llama(tmp_path_factory.mktemp("server-model"))
    adapters = tmp_path_factory.mktemp("server-adapters")
    make_adapters(model, adapters, n=3, ranks=(4, 8), strength=0.5, prefix="a")
    return model, adapters


@pytest.fixture(scope="session")
def server(
    tiny: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    model, adapters = tiny
    log = tmp_path_factory.mktemp("logs") / "server.log"
    running = start_server(model, adapters, "--cold-loads-per-minute", "100", log=log)
    yield running
    assert running.stop() == 0, log.read_text()


@pytest.fixture(scope="module")
def ray_port() -> Iterator[int]:
    """A local Ray of two CPUs (no dashboard) for the module's Ray Serve fleets, and a free port
    for their HTTP proxy; Serve and Ray shut down after the module."""
    ray = pytest.importorskip("ray", reason="needs lora-guard[ray]")
    serve = pytest.importorskip("ray.serve")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield free_port()
    finally:
        serve.shutdown()
        ray.shutdown()


def fault_plugin_env(hold_file: Path) -> dict[str, str]:
    """The environment for a server started with ``--plugin faults:injector`` (faults.py)."""
    here = str(Path(__file__).parent)
    path = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH", "")) if p)
    return {"PYTHONPATH": path, "FAULTS_HOLD_FILE": str(hold_file)}


@pytest.fixture(scope="session")
def fault_env() -> Callable[[Path], dict[str, str]]:
    """``fault_env(hold_file)``: the environment that lets a server load the fault plugin."""
    return fault_plugin_env


CHECK_PROMPTS = ("The capital of France is", "A LoRA adapter changes the")
CHECK_TOKENS = 8


@pytest.fixture(scope="session")
def expected(tiny: tuple[Path, Path]) -> dict[tuple[str, str | None], list[int]]:
    """Greedy tokens (``CHECK_TOKENS`` of them) of the in-process engine for each check prompt
    on the base model and on each ``tiny`` adapter: what every healthy server must answer."""
    model, adapters = tiny
    table = {p.name: p for p in sorted(adapters.iterdir()) if p.is_dir()}
    keys = [(prompt, a) for prompt in CHECK_PROMPTS for a in (None, *table)]
    return dict(zip(keys, engine_greedy(model, table, keys, CHECK_TOKENS), strict=True))


@pytest.fixture(scope="session")
def serves_correctly(
    expected: dict[tuple[str, str | None], list[int]],
) -> Callable[..., None]:
    """``serves_correctly(url, adapters=None, headers=None)``: assert that every check prompt on
    every adapter (or on ``adapters``) answers 200 with the in-process engine's tokens."""

    def check(
        url: str, adapters: list[str | None] | None = None, headers: dict[str, str] | None = None
    ) -> None:
        for (prompt, adapter), tokens in expected.items():
            if adapters is not None and adapter not in adapters:
                continue
            parameters = {"max_new_tokens": CHECK_TOKENS, "adapter_id": adapter}
            body = {"inputs": prompt, "parameters": parameters}
            r = httpx.post(url + "/generate", json=body, headers=headers or {}, timeout=60)
            assert r.status_code == 200, (adapter, r.text)
            assert [t["id"] for t in r.json()["details"]["tokens"]] == tokens, (prompt, adapter)

    return check


@pytest.fixture(scope="session")
def vllm_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random Llama with a head size vLLM's CPU attention takes (64), and room for long
    generations."""
    return make_tiny_llama(
        tmp_path_factory.mktemp("vllm-model"),
        hidden_size=256,
        intermediate_size=512,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
    )


@pytest.fixture(scope="session")
def vllm_python() -> Path:
    """vLLM's environment, made as the bench makes it, with this checkout of lora-guard installed
    into it (its own dependencies are vLLM's, but pluggy)."""
    python = PEERS[os.environ.get("VLLM_PEER", "vllm")].make()  # make test-vllm VLLM_PEER=...
    pip = [str(python), "-m", "pip", "-q", "--disable-pip-version-check", "install"]
    checkout = Path(lora_guard.__file__).resolve().parents[1]
    subprocess.run([*pip, "pluggy>=1.5"], check=True)
    subprocess.run([*pip, "--no-deps", "-e", str(checkout)], check=True)
    return python


@contextmanager
def serve_vllm(
    python: Path,
    model: Path,
    adapters: Mapping[str, Path],
    log: Path,
    *,
    args: Sequence[str] = (),
    environment: Mapping[str, str] | None = None,
) -> Iterator[str]:
    """``vllm serve`` of ``model`` as ``tiny`` with LoRA ``adapters`` (rank 8 at most), float32,
    prefix caching on, tuned for this machine's cores; yields its URL."""
    port = free_port()
    modules = [f"{name}={folder}" for name, folder in adapters.items()]
    # flags and their values side by side, as on a command line (fmt: skip)
    command = [
        str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
        "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(port),
        "--dtype", "float32", "--kv-cache-memory-bytes", str(64 * 2**20),
        "--enable-lora", "--max-lora-rank", "8", "--lora-modules", *modules,
        "--enable-prefix-caching", "--enable-prompt-tokens-details", *args,
    ]  # fmt: skip
    env = {
        "VLLM_CPU_OMP_THREADS_BIND": cpu_list({0, 1}),
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True",
        "LORA_GUARD_VLLM_DIR": str(log.parent / f"lora-guard-vllm-{port}"),
        **(environment or {}),
    }
    server = start_process(ServerLaunch(command, env), log)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(server, url, log)
        yield url
    finally:
        stop_server(server)


@pytest.fixture(scope="session")
def vllm_serve() -> Callable[..., AbstractContextManager[str]]:
    """:func:`serve_vllm`, for the vLLM tests."""
    return serve_vllm
