"""vLLM's adapter loads timed where they happen, in its worker, for ``lora_guard_adapter_swap_ms``
and ``vllm:lora_adapter_load_seconds``: the read from disk (``WorkerLoRAManager._load_adapter``,
``load``) and the copy into a device seat (``LoRAModelManager.activate_adapter``, ``activate``).

vLLM loads every installed general plugin (entry point ``vllm.general_plugins``) in each of its
processes; :func:`register` wraps those two methods, and a worker times its loads only where
lora-guard's scheduler runs (``--scheduler-cls lora_guard.vllm...``). Each load is one JSON line
in the channel folder's ``loads.jsonl``, which the scheduler takes after the step that loaded it.
Where vLLM's methods are not there, or have another shape, nothing is wrapped and the scheduler
times a load by its step, as before.
"""

from __future__ import annotations

import functools
import inspect
import os
import threading
from pathlib import Path
from typing import Any

from lora_guard.clock import timer
from lora_guard.vllm import channel

LOADS_FILE = "loads.jsonl"
_current = threading.local()  # the adapter add_adapter is bringing in, and where to write


def register() -> None:
    """vLLM's general-plugin entry point: wrap the worker's adapter loads."""
    try:
        from vllm.lora import model_manager, worker_manager
    except ImportError:
        return
    workers = worker_manager.WorkerLoRAManager
    if getattr(workers, "_lora_guard_timed", False) or not _has_seams(
        workers, model_manager.LoRAModelManager
    ):
        return
    workers._lora_guard_timed = True
    init = workers.__init__

    @functools.wraps(init)
    def __init__(self: Any, vllm_config: Any, *args: Any, **kwargs: Any) -> None:
        init(self, vllm_config, *args, **kwargs)
        self._lora_guard_loads = loads_file(vllm_config)

    workers.__init__ = __init__
    for cls in (workers, *workers.__subclasses__()):
        if "add_adapter" in vars(cls):
            cls.add_adapter = _bringing(cls.add_adapter)
    workers._load_adapter = _timed(workers._load_adapter, "load")
    models = model_manager.LoRAModelManager
    models.activate_adapter = _timed(models.activate_adapter, "activate")


def _has_seams(workers: type, models: type) -> bool:
    def starts(method: Any, *names: str) -> bool:
        return (
            callable(method) and tuple(inspect.signature(method).parameters)[: len(names)] == names
        )

    return (
        starts(vars(workers).get("__init__"), "self", "vllm_config")
        and starts(getattr(workers, "add_adapter", None), "self")
        and starts(getattr(workers, "_load_adapter", None), "self", "lora_request")
        and starts(getattr(models, "activate_adapter", None), "self", "lora_id")
    )


def loads_file(vllm_config: Any) -> Path | None:
    """Where this worker writes its loads: the channel folder of lora-guard's scheduler, found
    as the scheduler finds it; None where another scheduler runs."""
    scheduler = getattr(getattr(vllm_config, "scheduler_config", None), "scheduler_cls", None)
    if "lora_guard" not in str(scheduler):
        return None
    backend = getattr(vllm_config.parallel_config, "distributed_executor_backend", None)
    if backend != "mp":  # the worker runs in the engine core, where the scheduler runs
        return channel.channel_dir(channel.front_end_pid()) / LOADS_FILE
    engine_core = os.getppid()  # a worker process of the engine core's
    in_front_end = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") == "0"
    front_end = engine_core if in_front_end else _parent_of(engine_core)
    return channel.channel_dir(front_end) / LOADS_FILE


def _parent_of(pid: int) -> int:
    """``pid``'s parent (the front end, for the engine core); ``pid`` where /proc says nothing."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return int(stat.rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return pid


def _bringing(add_adapter: Any) -> Any:
    @functools.wraps(add_adapter)
    def wrapped(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        _current.adapter = getattr(request, "lora_name", None)
        _current.path = getattr(self, "_lora_guard_loads", None)
        try:
            return add_adapter(self, request, *args, **kwargs)
        finally:
            _current.adapter = _current.path = None

    return wrapped


def _timed(method: Any, transition: str) -> Any:
    @functools.wraps(method)
    def wrapped(self: Any, *args: Any, **kwargs: Any) -> Any:
        started = timer()
        result = method(self, *args, **kwargs)
        path, adapter = getattr(_current, "path", None), getattr(_current, "adapter", None)
        if path is not None and adapter is not None and result is not False:
            seconds = timer() - started
            record = {"adapter": adapter, "transition": transition, "seconds": seconds}
            channel.append_line(path, record)
        return result

    return wrapped


def take_timed_loads(folder: Path | None) -> dict[str, dict[str, float]]:
    """Seconds of each transition (``load``, ``activate``) of each adapter the worker loaded
    since the last time they were taken, from ``folder``'s ``loads.jsonl`` (None: none)."""
    timed: dict[str, dict[str, float]] = {}
    if folder is None:
        return timed
    for line in channel.take_lines(folder / LOADS_FILE):
        per = timed.setdefault(str(line.get("adapter")), {})
        transition = str(line.get("transition"))
        per[transition] = per.get(transition, 0.0) + float(line.get("seconds", 0.0))
    return timed
