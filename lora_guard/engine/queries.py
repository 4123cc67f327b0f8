"""What callers outside the engine ask of it: the admin routes, the bench, a replica's stats and
the cost calibration. :class:`LLMEngine` answers through these methods, so that no caller reaches
into its parts (residency, block manager, cache pool, model). Like the rest of the engine, they
run on the engine's thread (``AsyncEngine.call`` from a server)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from lora_guard.clock import timer
from lora_guard.engine.config import EngineConfig
from lora_guard.engine.cost_meter import CostMeter
from lora_guard.engine.errors import UnknownAdapterError
from lora_guard.engine.lora.checkpoint import LoRAAdapter, config_rank, read_adapter
from lora_guard.engine.lora.loader import ModelledReads
from lora_guard.engine.lora.tiers import Need
from lora_guard.engine.runner import ModelRunner
from lora_guard.engine.scheduler import Scheduler
from lora_guard.engine.spec import ModelSpec
from lora_guard.plugins.decisions import Load
from lora_guard.plugins.state import EngineState

MIB = 2**20
_TIERS = {"hot": "device", "warm": "host", "cold": "disk"}  # as the admin route names them


def _tier_name(tier: str) -> str:
    return _TIERS.get(tier, tier)  # "loading" stays


@dataclass(frozen=True, slots=True)
class ResidencyFigures:
    """The residency's counters since the engine started, and what it holds now."""

    loads: int  # adapters written into the pool (or merged)
    evictions: int
    swap_ms: tuple[float, ...]  # each load, its read from disk included
    peak_resident: int  # the most adapters resident at once
    resident: tuple[str, ...]  # adapters whose current weights a step can compute with now
    merged_mode: bool  # the baselines' one adapter merged into the weights
    kv_conflicts: int  # cached blocks a different adapter's request would have reused
    kv_blocks_used: int


@dataclass(frozen=True, slots=True)
class MemoryFigures:
    """The engine's memory by its own accounting (bytes)."""

    weights: int
    cache_pool: int  # KV blocks and adapter pages share it
    page_bytes: int
    merge_copies: int  # copies a merge keeps now
    merge_transient: int  # what a merge adds while it runs (0 unless merged mode)


@dataclass(frozen=True, slots=True)
class AdapterRow:
    """One registered adapter as ``GET /v1/adapters`` lists it."""

    id: str
    tier: str  # device, host or disk
    pinned: bool
    rank: int | None
    bytes: int | None
    heat: int


@dataclass(frozen=True, slots=True)
class ReloadTiming:
    """One adapter read from its folder and written into the pool again (milliseconds)."""

    read_ms: float
    write_ms: float
    mib: float  # its pages' bytes in the pool


class EngineQueries:
    """The methods of :class:`LLMEngine` that callers outside the engine use."""

    config: EngineConfig
    scheduler: Scheduler
    runner: ModelRunner

    # the state and the figures
    def state(self) -> EngineState:
        """The policies' view of the engine, taken now."""
        return self.scheduler.state(fresh=True)

    def figures(self) -> ResidencyFigures:
        adapters, blocks = self.scheduler.adapters, self.scheduler.blocks
        stats = adapters.stats
        return ResidencyFigures(
            stats.loads,
            stats.evictions,
            tuple(stats.swap_ms),
            stats.peak_resident,
            adapters.resident_adapters(),
            adapters.merged_mode,
            blocks.stats.conflicts,
            blocks.num_used_blocks,
        )

    def memory(self) -> MemoryFigures:
        model, pool = self.runner.model, self.runner.pool
        merged = self.scheduler.adapters.merged_mode
        return MemoryFigures(
            model.weight_bytes(),
            pool.nbytes(),
            pool.nbytes() // pool.num_pages,
            model.merge_copy_bytes(),
            model.merge_transient_bytes() if merged else 0,
        )

    def step_bytes(self) -> int:
        """Bytes of base weights one step reads."""
        return self.runner.model.step_bytes()

    @property
    def costs(self) -> CostMeter:
        """What the engine's steps say a page costs to bring back (a replay on a modelled clock
        feeds it the modelled costs instead: ``costs.external``)."""
        return self.scheduler.adapters.costs

    def adapter_pages(self, adapter_ids: list[str]) -> dict[str, int]:
        """Pool pages each of ``adapter_ids`` takes (resident, or once in host memory)."""
        return self.scheduler.adapters.pages_by_adapter(adapter_ids)

    def adapter_page_bytes(self, adapter: LoRAAdapter) -> int:
        """Bytes ``adapter`` takes in the pool."""
        return self.runner.pool.layout(adapter).nbytes

    def model_reads(self, reads: ModelledReads) -> None:
        """Let reads from disk land when ``reads`` says (a replay on a modelled clock)."""
        self.scheduler.adapters.loader.modelled = reads

    def wait_for_reads(self) -> None:
        """Block until every read from disk under way has ended (it lands at the next step)."""
        while not all(f.done() for f in self.scheduler.adapters.loader.pending.values()):
            time.sleep(0.0005)

    # adapters
    @property
    def model_spec(self) -> ModelSpec:
        return self.runner.model.spec

    def adapter_ids(self) -> list[str]:
        return sorted(self.scheduler.adapters.registry.entries)

    def knows_adapter(self, adapter_id: str) -> bool:
        return self.scheduler.adapters.knows(adapter_id)

    def read_adapter(self, adapter_id: str, folder: Path, root: Path | None = None) -> LoRAAdapter:
        """Read and check an adapter's folder against this model, as a load would; raises
        ``AdapterError``. Reads nothing of the engine that changes: safe off its thread."""
        spec, max_rank = self.runner.model.spec, self.config.max_lora_rank
        return read_adapter(adapter_id, folder, spec, max_rank, root)

    def register_adapter(self, adapter_id: str, folder: Path, root: Path | None = None) -> None:
        """Add an adapter, or replace one (requests under the old weights finish under them)."""
        self.scheduler.adapters.register(adapter_id, folder, root)

    def unregister_adapter(self, adapter_id: str) -> None:
        self._known(adapter_id)
        self.scheduler.adapters.unregister(adapter_id)

    def pin_adapter(self, adapter_id: str, pin: bool = True) -> tuple[str, ...]:
        """Pin (or unpin) an adapter; the pins after it. ``ValueError`` when pinning would
        leave no seat for the others."""
        self._known(adapter_id)
        usage = self.scheduler.adapters.usage  # the policies and metrics read the same pins
        if pin:
            usage.pin(adapter_id)
        else:
            usage.unpin(adapter_id)
        return usage.pinned

    def adapter_rows(self) -> list[AdapterRow]:
        adapters, view = self.scheduler.adapters, self.state()
        rows = []
        for adapter_id, entry in sorted(adapters.registry.entries.items()):
            host = adapters.host.entries.get(adapter_id)
            rows.append(
                AdapterRow(
                    adapter_id,
                    _tier_name(adapters.tier(adapter_id).value),
                    adapter_id in view.pinned,
                    host.rank if host else config_rank(entry.path),
                    host.nbytes if host else _weights_bytes(entry.path),
                    view.heat.get(adapter_id, 0),
                )
            )
        return rows

    def time_reload(self, adapter_id: str) -> ReloadTiming:
        """Read a resident adapter from its folder, evict it and write it into the pool again:
        the costs the simulator is calibrated with. Paged residency only."""
        from lora_guard.engine.lora.residency import ResidencyManager

        residency = self.scheduler.adapters
        assert isinstance(residency, ResidencyManager), "loads are measured on the pool"
        entry = residency.registry.get(adapter_id)
        resident = residency.current(adapter_id)
        if entry is None or resident is None:
            raise ValueError(f"adapter {adapter_id!r} is not resident")
        started = timer()
        adapter = self.read_adapter(adapter_id, entry.path, entry.root)
        read_ms = (timer() - started) * 1000
        assert resident.content_hash == adapter.content_hash
        started = timer()
        residency.evict(resident)
        need = Need(adapter_id, None, ready=False)
        brought = residency.bring_in(need, Load(), self.scheduler.running, parked=False)
        write_ms = (timer() - started) * 1000
        placed = residency.current(adapter_id)
        assert brought and placed is not None
        return ReloadTiming(read_ms, write_ms, placed.layout.nbytes / MIB)

    def _known(self, adapter_id: str) -> None:
        if not self.scheduler.adapters.knows(adapter_id):
            raise UnknownAdapterError(f"adapter {adapter_id!r} is not known")


def _weights_bytes(path: Path) -> int | None:
    try:
        return (path / "adapter_model.safetensors").stat().st_size
    except OSError:
        return None
