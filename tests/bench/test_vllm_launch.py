"""vLLM started as its CPU documentation asks: compute threads on every core lora-guard gets, no
core held back, the engine's KV space to the byte, tcmalloc when the machine has it."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from lora_guard.bench.replay import EngineOptions
from lora_guard.bench.servers import shared
from lora_guard.bench.vllm_peer import (
    Placement,
    cpu_list,
    guard_launch,
    peer_launch,
    peer_options,
    vllm_launch,
    vllm_mode,
)
from lora_guard.engine.values import parse_memory

ONE, TWO = frozenset({0}), frozenset({0, 1})
OPTIONS = EngineOptions(
    model="/models/m",
    adapter_dir="/adapters",
    max_loras=4,
    kv_cache_memory="768MiB",
    dtype="bfloat16",
)


def flag(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


def test_the_launch_binds_every_core_and_gives_our_kv_space() -> None:
    launch = vllm_launch(Path("/venv/bin/python"), OPTIONS, ["a", "b"], 8701, Placement(cores=TWO))
    assert launch.environment["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"
    assert launch.environment["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"
    assert int(flag(launch.command, "--kv-cache-memory-bytes")) == parse_memory("768MiB")
    assert flag(launch.command, "--dtype") == "bfloat16"  # each side in the same dtype
    assert flag(launch.command, "--max-loras") == "4"
    assert launch.command[-2:] == ["a=/adapters/a", "b=/adapters/b"]
    assert launch.as_json() == {"command": launch.command, "environment": launch.environment}


def test_the_guarded_peer_adds_lora_guards_scheduler_door_and_the_benchs_budget() -> None:
    plain = vllm_launch(Path("/venv/bin/python"), OPTIONS, ["a", "b"], 8701, Placement(cores=TWO))
    guarded = guard_launch(plain, OPTIONS, Path("/scratch/channel"), {})
    assert guarded.command[: len(plain.command)] == plain.command  # vLLM tuned the same way
    assert flag(guarded.command, "--scheduler-cls") == "lora_guard.vllm.AsyncScheduler"
    assert flag(guarded.command, "--middleware") == "lora_guard.vllm.Door"
    budget = guarded.environment["LORA_GUARD_COLD_LOADS_PER_MINUTE"]
    assert budget == str(OPTIONS.cold_loads_per_minute)
    assert guarded.environment["LORA_GUARD_VLLM_DIR"] == "/scratch/channel"
    # policies without a cold budget: no budget setting, which lora-guard would refuse
    without = guard_launch(plain, OPTIONS, Path("/c"), {"LORA_GUARD_POLICIES": "hot-set"})
    assert "LORA_GUARD_COLD_LOADS_PER_MINUTE" not in without.environment


def test_the_all_resident_bound_is_vllm_alone_with_a_seat_for_every_adapter() -> None:
    adapters = ["a", "b", "c", "d", "e", "f"]
    python, scratch = Path("/venv/bin/python"), Path("/scratch")
    plain = peer_launch("vllm", python, OPTIONS, adapters, 8701, scratch)
    bound = peer_launch("vllm-all-resident", python, OPTIONS, adapters, 8701, scratch)
    assert flag(plain.command, "--max-loras") == "4"
    assert flag(bound.command, "--max-loras") == "6"
    assert "--scheduler-cls" not in bound.command  # vLLM's own scheduler
    assert bound.environment == plain.environment  # tuned the same way
    at = plain.command.index("--max-loras") + 1
    assert (
        bound.command[:at] + bound.command[at + 1 :] == plain.command[:at] + plain.command[at + 1 :]
    )
    guarded = peer_launch("vllm-lora-guard", python, OPTIONS, adapters, 8701, scratch)
    assert flag(guarded.command, "--max-loras") == "4"
    assert guarded.environment["LORA_GUARD_VLLM_DIR"] == "/scratch/lora-guard-vllm-8701"
    # The report's seat count is the one each launch was given.
    seats = {p: peer_options(p, OPTIONS, adapters).max_loras for p in ("vllm", "vllm-lora-guard")}
    assert seats == {"vllm": 4, "vllm-lora-guard": 4}
    assert peer_options("vllm-all-resident", OPTIONS, adapters).max_loras == 6


def test_tcmalloc_and_intel_openmp_are_preloaded_as_the_docs_ask(tmp_path: Path) -> None:
    library = tmp_path / "libtcmalloc_minimal.so.4"
    library.touch()
    python = tmp_path / "venv" / "bin" / "python"  # intel-openmp puts libiomp5.so in venv/lib
    (tmp_path / "venv" / "lib").mkdir(parents=True)
    (tmp_path / "venv" / "lib" / "libiomp5.so").touch()
    with_it = vllm_launch(python, OPTIONS, [], 8701, Placement(cores=ONE, tcmalloc=library))
    iomp = tmp_path / "venv" / "lib" / "libiomp5.so"
    assert with_it.environment["LD_PRELOAD"] == f"{library}:{iomp}"
    assert "--enable-lora" not in with_it.command  # no adapters: the base model alone
    missing = vllm_launch(
        Path("python"), OPTIONS, [], 8701, Placement(tcmalloc=tmp_path / "none.so")
    )
    assert "LD_PRELOAD" not in missing.environment  # nothing named that is not there


def test_the_documented_layout_keeps_a_core_for_the_serving_process() -> None:
    launch = vllm_launch(Path("/venv/bin/python"), OPTIONS, ["a"], 8701, Placement("reserved"))
    # vLLM's own default: it binds its threads itself and keeps a core back
    assert "VLLM_CPU_OMP_THREADS_BIND" not in launch.environment
    assert "VLLM_CPU_NUM_OF_RESERVED_CPU" not in launch.environment
    with pytest.raises(ValueError, match="unknown core layout"):
        vllm_launch(Path("/venv/bin/python"), OPTIONS, ["a"], 8701, Placement("half"))


def test_a_degraded_vllm_run_shows_in_its_mode() -> None:
    degraded = "\n".join(
        [
            "WARNING [cpu_worker.py:114] libtcmalloc is not found in LD_PRELOAD. For best ...",
            "WARNING [cpu_worker.py:114] libiomp is not found in LD_PRELOAD. For best ...",
            "WARNING [cpu.py:224] Triton is not installed. triton-cpu is expected on x86 CPUs.",
            "WARNING [vllm.py:725] Model Runner V2 requires Triton; using the V1 model runner "
            "instead.",
            "INFO compilation_config={'mode': <CompilationMode.NONE: 0>, ...}",
            "INFO [ompmultiprocessing.py:185] \treserved_cpus=[]",
        ]
    )
    assert vllm_mode(degraded) == {
        "tcmalloc_preloaded": False,
        "iomp_preloaded": False,
        "triton": False,
        "model_runner": "V1",
        "compilation": "NONE",
        "reserved_cpus": "[]",
    }
    tuned = vllm_mode("INFO [ompmultiprocessing.py:185] \treserved_cpus=[0]")
    assert tuned["tcmalloc_preloaded"] and tuned["iomp_preloaded"] and tuned["triton"]
    assert tuned["reserved_cpus"] == "[0]"


def test_cpu_lists_are_written_as_linux_writes_them() -> None:
    assert cpu_list({0}) == "0"
    assert cpu_list({0, 1, 2, 5, 7, 8}) == "0-2,5,7-8"


def test_the_report_writes_paths_under_the_home_as_the_variable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LORA_GUARD_HOME", str(tmp_path))
    options = EngineOptions(model=str(tmp_path / "demo" / "model"), adapter_dir="/elsewhere")
    shown = vllm_launch(Path("python"), options, ["a"], 8701, Placement(cores=ONE)).as_json()
    assert "$LORA_GUARD_HOME/demo/model" in shown["command"]
    assert "a=/elsewhere/a" in shown["command"]  # a path outside it stays as given
    assert not any(str(tmp_path) in arg for arg in shown["command"])


def test_the_report_writes_the_temporary_folder_without_the_machines_path() -> None:
    scratch = Path(tempfile.gettempdir()) / "lora-guard-sweep-x" / "requests.jsonl"
    shown = shared(f"--request-log {scratch}")
    assert shown == "--request-log <tmp>/lora-guard-sweep-x/requests.jsonl"
