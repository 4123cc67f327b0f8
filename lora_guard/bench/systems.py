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

import importlib
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
    # where the server logs each request's times (lora_guard.server.request_log), if it does
    request_log: Path | None = None


Log = Callable[[str], None]
#: starts a system on the sweep's checkpoint, adapters, dtype and port
Make = Callable[[EngineOptions, list[str], int, Log], "System"]


def _python_server(program: list[str], options: EngineOptions, port: int) -> list[str]:
    """``python -m <program>`` on the options' model, adapters and dtype, on loopback ``port``."""
    command = [sys.executable, "-m", *program, "--model", str(options.model)]
    command += ["--adapter-dir", str(options.adapter_dir), "--dtype", options.dtype]
    command += ["--host", "127.0.0.1", "--port", str(port)]
    return command


def _lora_guard(options: EngineOptions, adapters: list[str], port: int, log: Log) -> System:
    command = _python_server(["lora_guard.cli", "serve"], options, port)
    command += ["--cache-memory", str(options.kv_cache_memory)]
    command += ["--max-num-seqs", str(options.max_num_seqs)]
    if options.max_loras:
        command += ["--max-loras", str(options.max_loras)]
    request_log = None if options.request_log is None else Path(options.request_log)
    if request_log is not None:
        command += ["--request-log", str(request_log)]
    counters = ("lora_guard_prefix_cache_hit_tokens_total", "tgi_request_input_length_sum")
    # "tgi": its base model's alias
    return System("lora-guard", ServerLaunch(command, {}), by_model("tgi"), counters, request_log)


def _peft(options: EngineOptions, adapters: list[str], port: int, log: Log) -> System:
    from lora_guard.bench.peft_server import BASE_NAME

    command = _python_server(["lora_guard.bench.peft_server"], options, port)
    command += ["--adapters", ",".join(adapters)]
    return System("peft", ServerLaunch(command, {}), by_model(BASE_NAME))


@dataclass(frozen=True)
class Entry:
    """A system the sweep can measure: how it is started, and what lora-guard's tokens/s must
    reach over its own, saturated and at one client (None: not judged)."""

    name: str
    make: Make | str  # or where its peer module keeps it, "module:function" (read when used)
    throughput_goal: float | None = None
    one_client_goal: float | None = None

    def start(self) -> Make:
        if not isinstance(self.make, str):
            return self.make
        module, _, function = self.make.partition(":")
        made: Make = getattr(importlib.import_module(module), function)
        return made


#: Every system ``--systems`` names; a new peer is a module with its ``sweep_system`` and a line
#: here.
SYSTEMS: dict[str, Entry] = {
    e.name: e
    for e in (
        Entry("lora-guard", _lora_guard),
        Entry("peft", _peft, throughput_goal=2.0),
        Entry("vllm", "lora_guard.bench.vllm_peer:sweep_system", throughput_goal=3.0),
        Entry("vllm-reserved", "lora_guard.bench.vllm_peer:reserved_system", throughput_goal=3.0),
        Entry("llama.cpp", "lora_guard.bench.llama_cpp_peer:sweep_system", 1.5, 1.0),
    )
}


def make_system(
    name: str, options: EngineOptions, adapters: list[str], port: int, log: Log
) -> System:
    try:
        entry = SYSTEMS[name]
    except KeyError:
        raise ValueError(f"unknown system {name!r}; choose from {', '.join(SYSTEMS)}") from None
    return entry.start()(options, adapters, port, log)


def by_model(base: str) -> Body:
    def body(request: TraceRequest) -> dict[str, object]:
        return {"model": request.adapter_id or base}

    return body


def by_lora_list(adapters: list[str]) -> Body:
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
