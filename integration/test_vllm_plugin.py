"""lora-guard inside vLLM (``make test-vllm``): vLLM's CPU build in its own environment, as the
bench makes it, with lora-guard installed into it, serving a tiny model and a LoRA adapter.

With ``--middleware lora_guard.vllm.KVScope`` and tenant scope, a tenant's repeated prompt hits
its own prefix cache, another tenant's identical prompt does not, and an adapter reloaded under
the same name and folder with new weights misses the KV of the old ones. Without it, in the same
steps, vLLM shares both (its key is the adapter's name and path only).
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

import lora_guard
from lora_guard.bench.peer_env import PEERS
from lora_guard.bench.servers import ServerLaunch, start_server, stop_server, wait_ready
from lora_guard.bench.vllm_peer import cpu_list
from lora_guard.demo.adapters import make_adapters
from lora_guard.demo.testing import free_port, make_tiny_llama

pytestmark = pytest.mark.vllm

# a prompt of several 16-token blocks, so that a hit is visible in cached_tokens
PROMPT = "a system prompt shared by every request of a tenant: " + " ".join(
    f"rule {i} says keep answers short and polite." for i in range(3)
)


@pytest.fixture(scope="module")
def vllm_python() -> Path:
    """vLLM's environment, with this checkout of lora-guard installed into it (its own
    dependencies are vLLM's, but pluggy)."""
    python = PEERS["vllm"].make()
    pip = [str(python), "-m", "pip", "-q", "--disable-pip-version-check", "install"]
    checkout = Path(lora_guard.__file__).resolve().parents[1]
    subprocess.run([*pip, "pluggy>=1.5"], check=True)
    subprocess.run([*pip, "--no-deps", "-e", str(checkout)], check=True)
    return python


@pytest.fixture(scope="module")
def tiny_for_vllm(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """A random Llama with a head size vLLM's CPU attention takes (64), and two adapters."""
    model = make_tiny_llama(
        tmp_path_factory.mktemp("vllm-model"),
        hidden_size=256,
        intermediate_size=512,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    out = tmp_path_factory.mktemp("vllm-adapters")
    first, second = make_adapters(model, out, n=2, ranks=(8,), prefix="v")
    return model, first, second


@contextmanager
def vllm_server(python: Path, model: Path, adapter: Path, log: Path, plugin: bool) -> Iterator[str]:
    port = free_port()
    # flags and their values side by side, as on a command line (fmt: skip)
    command = [
        str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
        "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(port),
        "--dtype", "float32", "--max-num-seqs", "4", "--kv-cache-memory-bytes", str(64 * 2**20),
        "--enable-lora", "--max-loras", "2", "--max-lora-rank", "8",
        "--lora-modules", f"a={adapter}", "--enable-prefix-caching",
        "--enable-prompt-tokens-details",
    ]  # fmt: skip
    if plugin:
        command += ["--middleware", "lora_guard.vllm.KVScope"]
    environment = {
        "VLLM_CPU_OMP_THREADS_BIND": cpu_list({0, 1}),
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True",
        "LORA_GUARD_KV_NAMESPACE_SCOPE": "tenant",
    }
    server = start_server(ServerLaunch(command, environment), log)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(server, url, log)
        yield url
    finally:
        stop_server(server)


def ask(url: str, tenant: str) -> tuple[int, str]:
    """Cached prompt tokens and the text of one greedy completion for ``tenant`` on adapter a."""
    body: dict[str, Any] = {"model": "a", "prompt": PROMPT, "max_tokens": 6, "temperature": 0}
    headers = {"X-Tenant-Id": tenant}
    reply = httpx.post(url + "/v1/completions", json=body, headers=headers, timeout=120)
    assert reply.status_code == 200, reply.text
    answer = reply.json()
    return answer["usage"]["prompt_tokens_details"]["cached_tokens"], answer["choices"][0]["text"]


def reload_with_new_weights(url: str, folder: Path, weights_from: Path) -> None:
    """Adapter a's files replaced in place, then unloaded and loaded again: same name, same path."""
    weights = "adapter_model.safetensors"
    shutil.copyfile(weights_from / weights, folder / weights)
    for route, body in [
        ("unload", {"lora_name": "a"}),
        ("load", {"lora_name": "a", "lora_path": str(folder)}),
    ]:
        reply = httpx.post(f"{url}/v1/{route}_lora_adapter", json=body, timeout=60)
        assert reply.status_code == 200, reply.text


def run_steps(
    python: Path, tiny: tuple[Path, Path, Path], tmp_path: Path, plugin: bool
) -> dict[str, tuple[int, str]]:
    model, first, second = tiny
    folder = tmp_path / "a"
    shutil.copytree(first, folder)
    with vllm_server(python, model, folder, tmp_path / "vllm.log", plugin) as url:
        seen = {"A first": ask(url, "A"), "A again": ask(url, "A"), "B": ask(url, "B")}
        reload_with_new_weights(url, folder, second)
        seen["A after reload"] = ask(url, "A")
        seen["A again after reload"] = ask(url, "A")
    return seen


def test_kv_scope_keeps_tenants_and_adapter_versions_apart(
    vllm_python: Path, tiny_for_vllm: tuple[Path, Path, Path], tmp_path: Path
) -> None:
    seen = run_steps(vllm_python, tiny_for_vllm, tmp_path / "with", plugin=True)
    cached = {step: hit for step, (hit, _) in seen.items()}
    assert cached["A first"] == 0 and cached["A again"] > 0  # a tenant's own prefix is reused
    assert cached["B"] == 0  # another tenant's identical prompt is not
    assert cached["A after reload"] == 0  # nor is KV computed under the old weights
    assert cached["A again after reload"] > 0
    texts = {step: text for step, (_, text) in seen.items()}
    assert texts["A first"] == texts["A again"] == texts["B"]  # the salt changes no answer
    assert texts["A after reload"] == texts["A again after reload"]


def test_without_it_vllm_shares_prefixes_across_tenants_and_adapter_versions(
    vllm_python: Path, tiny_for_vllm: tuple[Path, Path, Path], tmp_path: Path
) -> None:
    seen = run_steps(vllm_python, tiny_for_vllm, tmp_path / "without", plugin=False)
    assert seen["B"][0] > 0  # tenant B hits tenant A's prefix
    assert seen["A after reload"][0] > 0  # the new weights read KV of the old ones
