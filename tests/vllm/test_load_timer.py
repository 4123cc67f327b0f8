"""The worker's adapter loads timed where they happen (``load_timer``), on stand-ins with the
shapes of vLLM's LoRA managers: one ``load`` and one ``activate`` line for an adapter brought in,
nothing for one already active, nothing under another scheduler. Inside a real vLLM:
``integration/test_vllm_scheduler.py``."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest

from lora_guard.vllm import channel, load_timer


class LoRAModelManager:
    def __init__(self) -> None:
        self.active: set[int] = set()

    def activate_adapter(self, lora_id: int) -> bool:
        if lora_id in self.active:
            return False
        self.active.add(lora_id)
        return True


class WorkerLoRAManager:
    def __init__(self, vllm_config: Any, device: Any = None) -> None:
        self.manager = LoRAModelManager()
        self.loaded: set[int] = set()

    def _load_adapter(self, lora_request: Any) -> object:
        time.sleep(0.01)
        return object()

    def add_adapter(self, lora_request: Any) -> bool:
        raise NotImplementedError


class LRUCacheWorkerLoRAManager(WorkerLoRAManager):
    def add_adapter(self, lora_request: Any) -> bool:
        if lora_request.lora_int_id not in self.loaded:
            self._load_adapter(lora_request)
            self.loaded.add(lora_request.lora_int_id)
        return self.manager.activate_adapter(lora_request.lora_int_id)


@pytest.fixture
def fake_vllm(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    lora = ModuleType("vllm.lora")
    workers = ModuleType("vllm.lora.worker_manager")
    models = ModuleType("vllm.lora.model_manager")
    for cls in (WorkerLoRAManager, LRUCacheWorkerLoRAManager):
        setattr(workers, cls.__name__, cls)
    models.LoRAModelManager = LoRAModelManager  # type: ignore[attr-defined]
    lora.worker_manager, lora.model_manager = workers, models  # type: ignore[attr-defined]
    for name, module in (
        ("vllm", ModuleType("vllm")),
        ("vllm.lora", lora),
        ("vllm.lora.worker_manager", workers),
        ("vllm.lora.model_manager", models),
    ):
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setenv(channel.DIR_ENV, str(tmp_path))
    load_timer.register()
    return tmp_path / load_timer.LOADS_FILE


def config(scheduler: str) -> Any:
    return SimpleNamespace(
        scheduler_config=SimpleNamespace(scheduler_cls=scheduler),
        parallel_config=SimpleNamespace(distributed_executor_backend="uni"),
    )


def test_a_load_is_timed_as_a_read_and_a_copy(fake_vllm: Path) -> None:
    worker = LRUCacheWorkerLoRAManager(config("lora_guard.vllm.AsyncScheduler"))
    request = SimpleNamespace(lora_name="a", lora_int_id=1)
    worker.add_adapter(request)
    worker.add_adapter(request)  # active already: no load, no copy
    lines = channel.take_lines(fake_vllm)
    assert [(r["adapter"], r["transition"]) for r in lines] == [("a", "load"), ("a", "activate")]
    assert lines[0]["seconds"] >= 0.01
    load_timer.register()  # a second registration wraps nothing twice
    worker.add_adapter(SimpleNamespace(lora_name="b", lora_int_id=2))
    assert len(channel.take_lines(fake_vllm)) == 2


def test_under_another_scheduler_nothing_is_written(fake_vllm: Path) -> None:
    worker = LRUCacheWorkerLoRAManager(config("vllm.v1.core.sched.scheduler.Scheduler"))
    worker.add_adapter(SimpleNamespace(lora_name="a", lora_int_id=1))
    assert not fake_vllm.exists()


def test_a_worker_finds_the_schedulers_folder(monkeypatch: pytest.MonkeyPatch) -> None:
    """In the engine core (vLLM's uni executor) the worker's folder is the scheduler's; a worker
    process of an in-process engine core (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) takes its parent's
    process id as the front end's."""
    monkeypatch.delenv(channel.DIR_ENV, raising=False)
    uni = config("lora_guard.vllm.AsyncScheduler")
    assert (
        load_timer.loads_file(uni) == channel.channel_dir(channel.front_end_pid()) / "loads.jsonl"
    )
    uni.parallel_config.distributed_executor_backend = "mp"
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    assert load_timer.loads_file(uni) == channel.channel_dir(os.getppid()) / "loads.jsonl"
