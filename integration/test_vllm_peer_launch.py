"""The bench's vLLM peer as its CPU documentation asks (``make test-vllm``): started by the same
launch the bench uses, in both core layouts, it finds tcmalloc (when the machine has it) and Intel's
OpenMP preloaded, serves an adapter, and its log says how it ran."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from lora_guard.bench.replay import EngineOptions
from lora_guard.bench.servers import start_server, stop_server, wait_ready
from lora_guard.bench.vllm_peer import (
    BASE_NAME,
    LAYOUTS,
    RESERVED,
    Placement,
    system_tcmalloc,
    vllm_launch,
    vllm_mode,
)
from lora_guard.demo.adapters import make_adapters
from lora_guard.demo.testing import free_port

pytestmark = pytest.mark.vllm


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_peer_runs_with_its_libraries_preloaded(
    layout: str, vllm_python: Path, vllm_model: Path, tmp_path: Path
) -> None:
    (adapter,) = make_adapters(vllm_model, tmp_path / "adapters", n=1, ranks=(8,), prefix="p")
    options = EngineOptions(
        model=str(vllm_model),
        adapter_dir=str(adapter.parent),
        max_loras=1,
        max_lora_rank=8,
        kv_cache_memory="64MiB",
        dtype="float32",
        max_num_seqs=4,
    )
    port = free_port()
    launch = vllm_launch(vllm_python, options, [adapter.name], port, Placement(layout))
    log = tmp_path / "vllm.log"
    server = start_server(launch, log)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_ready(server, url, log)
        for model in (adapter.name, BASE_NAME):
            body = {"model": model, "prompt": "hello", "max_tokens": 4, "temperature": 0}
            reply = httpx.post(url + "/v1/completions", json=body, timeout=300)
            assert reply.status_code == 200, reply.text
    finally:
        stop_server(server)
    mode = vllm_mode(log.read_text(errors="replace"))
    print(f"vLLM in layout {layout}: {mode}")
    assert mode["iomp_preloaded"], "libiomp5.so of vLLM's environment was not preloaded"
    assert mode["tcmalloc_preloaded"] == (system_tcmalloc() is not None)
    if layout == RESERVED:
        assert mode["reserved_cpus"] not in (None, "[]")  # a core kept for the serving process
    else:
        assert mode["reserved_cpus"] == "[]"
