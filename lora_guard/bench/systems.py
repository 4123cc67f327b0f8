"""The servers a capacity sweep measures, each started as its users start it, on the same
checkpoint, adapters, dtype, cores and KV space where the server lets it be set.

- ``lora-guard``: ``lora-guard serve`` (its defaults: prefix caching on), ``--cache-memory`` the KV
  space, adapters named by ``model``.
- ``peft``: transformers + PEFT behind :mod:`lora_guard.bench.peft_server` (continuous batching
  of mixed-adapter forwards, adapters in the model's dtype).
- ``vllm``: vLLM's CPU build as its CPU docs ask (:func:`lora_guard.bench.vllm_peer.vllm_launch`),
  computing on every core; ``vllm-reserved``: the same in its documented layout, a core kept for
  its serving process.
- ``llama.cpp``: ``llama-server`` built here (:mod:`lora_guard.bench.llama_cpp_peer`), the model
  and adapters converted to GGUF in the same dtype, one slot per client.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from lora_guard.bench.load import Body
from lora_guard.bench.replay import EngineOptions
from lora_guard.bench.servers import ServerLaunch
from lora_guard.workload.trace import TraceRequest


@dataclass(frozen=True)
class System:
    """A server the sweep measures: how to start it and what each request tells it."""

    name: str
    launch: ServerLaunch
    body: Body  # the request's adapter, as this server names it
    # the counters on its /metrics of prompt tokens found in its prefix cache and of all prompt
    # tokens, where it has both
    cache_counters: tuple[str, str] | None = None


def make_system(
    name: str,
    options: EngineOptions,
    adapters: list[str],
    port: int,
    log: Callable[[str], None],
) -> System:
    model, adapter_dir = Path(options.model), Path(options.adapter_dir)
    if name == "lora-guard":
        command = [
            sys.executable,
            "-m",
            "lora_guard.cli",
            "serve",
            "--model",
            str(model),
            "--adapter-dir",
            str(adapter_dir),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--cache-memory",
            str(options.kv_cache_memory),
            "--dtype",
            options.dtype,
            "--max-num-seqs",
            str(options.max_num_seqs),
        ]
        if options.max_loras:
            command += ["--max-loras", str(options.max_loras)]
        counters = ("lora_guard_prefix_cache_hit_tokens_total", "tgi_request_input_length_sum")
        # "tgi": its base model's alias
        return System(name, ServerLaunch(command, {}), _by_model("tgi"), counters)
    if name == "peft":
        from lora_guard.bench.peft_server import BASE_NAME

        command = [
            sys.executable,
            "-m",
            "lora_guard.bench.peft_server",
            "--model",
            str(model),
            "--adapter-dir",
            str(adapter_dir),
            "--adapters",
            ",".join(adapters),
            "--dtype",
            options.dtype,
            "--port",
            str(port),
        ]
        return System(name, ServerLaunch(command, {}), _by_model(BASE_NAME))
    if name in ("vllm", "vllm-reserved"):
        from lora_guard.bench.vllm_peer import (
            ALL_CORES,
            BASE_NAME,
            RESERVED,
            peer_python,
            vllm_launch,
        )

        layout = RESERVED if name == "vllm-reserved" else ALL_CORES
        launch = vllm_launch(peer_python(log=log), options, adapters, port, layout=layout)
        counters = ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total")
        return System(name, launch, _by_model(BASE_NAME), counters)
    if name == "llama.cpp":
        from lora_guard.bench import llama_cpp_peer as peer

        python = peer.llama_cpp_python(log)
        base, files = peer.gguf_files(python, model, adapter_dir, adapters, options.dtype, log)
        launch = peer.llama_cpp_launch(
            peer.server_binary(python),
            base,
            files,
            port,
            parallel=options.max_num_seqs,
            bos=peer.adds_bos(model),
        )
        return System(name, launch, _by_lora_list(adapters))
    raise ValueError(f"unknown system {name!r}")


def _by_model(base: str) -> Body:
    def body(request: TraceRequest) -> dict[str, object]:
        return {"model": request.adapter_id or base}

    return body


def _by_lora_list(adapters: list[str]) -> Body:
    """llama-server's per-request LoRA list. An empty list means "the server's own scales" (every
    adapter at 1), so the base model is asked for as one adapter at scale 0 (the rest default
    to 0)."""
    ids = {name: i for i, name in enumerate(adapters)}
    none = [{"id": 0, "scale": 0.0}] if adapters else []

    def body(request: TraceRequest) -> dict[str, object]:
        if request.adapter_id is None:
            return {"model": "base", "lora": none}
        return {"model": "base", "lora": [{"id": ids[request.adapter_id], "scale": 1.0}]}

    return body
