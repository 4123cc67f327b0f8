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
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import httpx
import pytest

from lora_guard.demo.adapters import make_adapters

pytestmark = pytest.mark.vllm

ServeVllm = Callable[..., AbstractContextManager[str]]

# a prompt of several 16-token blocks, so that a hit is visible in cached_tokens
PROMPT = "a system prompt shared by every request of a tenant: " + " ".join(
    f"rule {i} says keep answers short and polite." for i in range(3)
)


@pytest.fixture(scope="module")
def tiny_for_vllm(
    vllm_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, Path, Path]:
    """The tiny model vLLM takes, and two adapters."""
    out = tmp_path_factory.mktemp("vllm-adapters")
    first, second = make_adapters(vllm_model, out, n=2, ranks=(8,), prefix="v")
    return vllm_model, first, second


def vllm_server(
    serve: ServeVllm, python: Path, model: Path, adapter: Path, log: Path, plugin: bool
) -> AbstractContextManager[str]:
    extra = ["--middleware", "lora_guard.vllm.KVScope"] if plugin else []
    return serve(
        python,
        model,
        {"a": adapter},
        log,
        args=["--max-num-seqs", "4", "--max-loras", "2", *extra],
        environment={"LORA_GUARD_KV_NAMESPACE_SCOPE": "tenant"},
    )


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
    serve: ServeVllm, python: Path, tiny: tuple[Path, Path, Path], tmp_path: Path, plugin: bool
) -> dict[str, tuple[int, str]]:
    model, first, second = tiny
    folder = tmp_path / "a"
    shutil.copytree(first, folder)
    with vllm_server(serve, python, model, folder, tmp_path / "vllm.log", plugin) as url:
        seen = {"A first": ask(url, "A"), "A again": ask(url, "A"), "B": ask(url, "B")}
        reload_with_new_weights(url, folder, second)
        seen["A after reload"] = ask(url, "A")
        seen["A again after reload"] = ask(url, "A")
    return seen


def test_kv_scope_keeps_tenants_and_adapter_versions_apart(
    vllm_serve: ServeVllm, vllm_python: Path, tiny_for_vllm: tuple[Path, Path, Path], tmp_path: Path
) -> None:
    seen = run_steps(vllm_serve, vllm_python, tiny_for_vllm, tmp_path / "with", plugin=True)
    cached = {step: hit for step, (hit, _) in seen.items()}
    assert cached["A first"] == 0 and cached["A again"] > 0  # a tenant's own prefix is reused
    assert cached["B"] == 0  # another tenant's identical prompt is not
    assert cached["A after reload"] == 0  # nor is KV computed under the old weights
    assert cached["A again after reload"] > 0
    texts = {step: text for step, (_, text) in seen.items()}
    assert texts["A first"] == texts["A again"] == texts["B"]  # the salt changes no answer
    assert texts["A after reload"] == texts["A again after reload"]


def test_without_it_vllm_shares_prefixes_across_tenants_and_adapter_versions(
    vllm_serve: ServeVllm, vllm_python: Path, tiny_for_vllm: tuple[Path, Path, Path], tmp_path: Path
) -> None:
    seen = run_steps(vllm_serve, vllm_python, tiny_for_vllm, tmp_path / "without", plugin=False)
    assert seen["B"][0] > 0  # tenant B hits tenant A's prefix
    assert seen["A after reload"][0] > 0  # the new weights read KV of the old ones


CHANGED_SEAM = """
from vllm.v1.core.sched.scheduler import Scheduler as VllmScheduler

original = VllmScheduler.update_from_output


def update_from_output(self, output, runner_output):  # renamed, as a later release might
    return original(self, output, runner_output)


VllmScheduler.update_from_output = update_from_output
from lora_guard.vllm.scheduler import AsyncScheduler, Scheduler  # noqa: E402
"""


def test_the_installed_vllm_has_the_seams_the_scheduler_uses(vllm_python: Path) -> None:
    check = "from lora_guard.vllm.seams import scheduler_seams; print(scheduler_seams())"
    done = subprocess.run([str(vllm_python), "-c", check], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]"


def test_a_changed_seam_turns_the_scheduler_off_and_vllm_still_serves(
    vllm_serve: ServeVllm,
    vllm_python: Path,
    tiny_for_vllm: tuple[Path, Path, Path],
    tmp_path: Path,
) -> None:
    model, adapter, _ = tiny_for_vllm
    (tmp_path / "changed_seam.py").write_text(CHANGED_SEAM)
    log = tmp_path / "vllm.log"
    args = ["--max-loras", "2", "--scheduler-cls", "changed_seam.AsyncScheduler"]
    environment = {"PYTHONPATH": str(tmp_path)}
    with vllm_serve(
        vllm_python, model, {"a": adapter}, log, args=args, environment=environment
    ) as url:
        body = {"model": "a", "prompt": "hello", "max_tokens": 4, "temperature": 0}
        reply = httpx.post(url + "/v1/completions", json=body, timeout=120)
        assert reply.status_code == 200, reply.text
    said = [line for line in log.read_text().splitlines() if "lora_guard.vllm is off" in line]
    assert len(said) == 1 and "update_from_output" in said[0] and "runner_output" in said[0]
