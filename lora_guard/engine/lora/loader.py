"""The loader thread (disk reads off the step loop) and the host-memory tier below the pool."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from lora_guard.clock import timer
from lora_guard.engine.lora.checkpoint import AdapterError, LoRAAdapter, read_adapter
from lora_guard.engine.spec import ModelSpec
from lora_guard.engine.threads import serial_thread


class ModelledReads:
    """Reads that land when a modelled clock says (virtual time): one at a time, as the loader
    thread reads them, each taking ``cost_ms(adapter_id)`` of ``clock``'s time."""

    def __init__(self, clock: Callable[[], float], cost_ms: Callable[[str], float]) -> None:
        self.clock, self.cost_ms = clock, cost_ms
        self.due: dict[str, float] = {}
        self.free_at = 0.0  # when the loader thread finishes the reads queued so far

    def submitted(self, adapter_id: str) -> None:
        start = max(self.clock(), self.free_at)
        self.free_at = self.due[adapter_id] = start + self.cost_ms(adapter_id) / 1000

    def landed(self, adapter_id: str) -> bool:
        if self.clock() < self.due.get(adapter_id, 0.0):
            return False
        self.due.pop(adapter_id, None)
        return True

    def next_due(self) -> float | None:
        return min(self.due.values(), default=None)


class AdapterLoader:
    """Reads adapters from disk on a background thread so the step loop never waits on I/O."""

    def __init__(self, spec: ModelSpec, max_rank: int, dtype: torch.dtype = torch.float32) -> None:
        self.spec, self.max_rank, self.dtype = spec, max_rank, dtype
        self._pool = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="lora-guard-loader", initializer=serial_thread
        )
        self.pending: dict[str, Future[LoRAAdapter]] = {}
        self.read_ms: dict[str, float] = {}  # how long each finished read took, queue excluded
        self.modelled: ModelledReads | None = None  # set by a replay on a modelled clock

    def submit(self, adapter_id: str, path: Path, root: Path | None = None) -> None:
        if adapter_id not in self.pending:
            self.pending[adapter_id] = self._pool.submit(self._read, adapter_id, path, root)
            if self.modelled is not None:
                self.modelled.submitted(adapter_id)

    def _read(self, adapter_id: str, path: Path, root: Path | None) -> LoRAAdapter:
        started = timer()
        try:
            return read_adapter(adapter_id, path, self.spec, self.max_rank, root, self.dtype)
        finally:
            self.read_ms[adapter_id] = (timer() - started) * 1000

    def collect(self) -> list[tuple[str, LoRAAdapter | AdapterError]]:
        """Finished loads since the last call: an adapter, or the error that stopped it."""
        done: list[tuple[str, LoRAAdapter | AdapterError]] = []
        for adapter_id, future in list(self.pending.items()):
            if future.done() and (self.modelled is None or self.modelled.landed(adapter_id)):
                del self.pending[adapter_id]
                try:
                    done.append((adapter_id, future.result()))
                except AdapterError as exc:
                    done.append((adapter_id, exc))
                except Exception as exc:  # an unexpected failure is still that adapter's error
                    done.append((adapter_id, AdapterError(f"adapter {adapter_id!r}: {exc}")))
        return done

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class HostCache:
    """LRU of adapters in host memory (``max_cpu_loras``)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.entries: OrderedDict[str, LoRAAdapter] = OrderedDict()

    def get(self, adapter_id: str) -> LoRAAdapter | None:
        adapter = self.entries.get(adapter_id)
        if adapter is not None:
            self.entries.move_to_end(adapter_id)
        return adapter

    def put(self, adapter: LoRAAdapter) -> None:
        self.entries[adapter.adapter_id] = adapter
        self.entries.move_to_end(adapter.adapter_id)
        while len(self.entries) > self.capacity:
            self.entries.popitem(last=False)

    def drop(self, adapter_id: str) -> None:
        self.entries.pop(adapter_id, None)
