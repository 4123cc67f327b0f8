"""From settings to an engine: makes each part and hands it to its owner. The runner gets the
model and the cache pool's memory, the residency manager the adapters, the scheduler the page pool
(``page_pool.py``: the pool's pages, KV blocks and adapter runs alike) and the residency manager,
the engine the scheduler and the runner."""

from __future__ import annotations

import logging
from dataclasses import fields
from pathlib import Path
from typing import Any

from lora_guard.engine.config import EngineConfig
from lora_guard.engine.kv_cache import BlockManager
from lora_guard.engine.linear import blocked_layout_available
from lora_guard.engine.llm_engine import LLMEngine
from lora_guard.engine.lora.checkpoint import layer_elements, read_adapter
from lora_guard.engine.lora.compute import resolve_mode
from lora_guard.engine.lora.loader import AdapterLoader, HostCache
from lora_guard.engine.lora.merged import MergedResidency
from lora_guard.engine.lora.pool import CachePool
from lora_guard.engine.lora.registry import AdapterRegistry
from lora_guard.engine.lora.residency import ResidencyManager
from lora_guard.engine.lora.tiers import Residency, Sources
from lora_guard.engine.model import LlamaModel
from lora_guard.engine.page_pool import PagePool
from lora_guard.engine.pool_size import size_pool
from lora_guard.engine.request_check import RequestCheck
from lora_guard.engine.runner import ModelRunner
from lora_guard.engine.scheduler import Scheduler
from lora_guard.engine.spec import ModelSpec
from lora_guard.engine.values import ConfigError
from lora_guard.plugins.manager import Hooks, make_plugin_manager
from lora_guard.plugins.options import id_list

log = logging.getLogger(__name__)

MIN_KV_BLOCKS = 4


def build_engine(
    hooks: Hooks,
    policies: tuple[str, ...],
    settings: dict[str, Any],
    adapters: dict[str, str | Path] | None = None,
    adapter_dir: str | Path | None = None,
    **config: Any,
) -> LLMEngine:
    """An engine with ``hooks`` configured: the one path from settings to an engine, for the
    offline API and the server alike."""
    static_adapter = settings.get("static_adapter")
    if "static" in policies and not static_adapter:
        raise ConfigError(
            'policy static needs the adapter to serve: settings={"static_adapter": ID}'
        )
    engine_config = EngineConfig(
        **config,
        lora_mode="merged" if {"static", "on-demand"} & set(policies) else "slots",
        static_adapter=static_adapter if "static" in policies else None,
    )
    hooks.configure({**plain_settings(engine_config), **settings})
    engine = engine_from_config(engine_config, hooks, adapters, adapter_dir)
    usage = engine.adapters.usage  # the engine keeps the pins and the heat
    usage.arrivals.window_s = float(settings.get("heat_window_s", usage.arrivals.window_s))
    usage.pin(*id_list(settings.get("pin")))
    return engine


def plain_settings(config: EngineConfig) -> dict[str, Any]:
    """``config`` as the settings plugins are configured with: its values, not its clock."""
    return {f.name: getattr(config, f.name) for f in fields(config) if f.name != "clock"}


def engine_from_config(
    config: EngineConfig,
    hooks: Hooks | None = None,
    adapters: dict[str, str | Path] | None = None,
    adapter_dir: str | Path | None = None,
) -> LLMEngine:
    """The engine's parts, made from ``config`` and wired together."""
    from transformers import AutoTokenizer

    hooks = hooks if hooks is not None else Hooks(make_plugin_manager())
    model_dir = Path(config.model).expanduser()
    model = _model(config, model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model_id = config.model_id or model_name(model_dir, model.config)
    spec = model.spec
    registry = AdapterRegistry()
    if adapter_dir is not None:
        registry.add_dir(Path(adapter_dir).expanduser())
    for adapter_id, path in (adapters or {}).items():
        registry.add(adapter_id, Path(path).expanduser())
    num_pages, adapter_pages = _pool_pages(config, spec, registry)
    try:
        pool = CachePool(
            spec,
            num_pages,
            config.block_size,
            config.torch_dtype,
            config.torch_device,
            config.torch_lora_dtype,
        )
        lora_compute = resolve_mode(
            config.lora_compute, config.torch_dtype, config.torch_device, config.torch_lora_dtype
        )
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    runner = ModelRunner(
        model, pool, lora_compute, merge_for_good=config.static_adapter is not None
    )
    blocks = BlockManager(
        num_pages,
        config.block_size,
        config.enable_prefix_caching,
        clock=config.clock,
        kv_pages=num_pages - adapter_pages,
    )
    pages = PagePool(pool, blocks)
    residency = _residency(config, pages, registry, runner, hooks, spec)
    scheduler = Scheduler(
        pages,
        residency,
        hooks,
        model_id,
        config.max_batch_tokens,
        config.max_num_seqs,
        reject_when_busy=config.reject_when_busy,
        clock=config.clock,
    )
    check = RequestCheck(
        residency.registry,
        spec.vocab_size,
        max_model_len(config, spec, num_pages),
        config.static_adapter,
    )
    return LLMEngine(config, hooks, tokenizer, model_id, scheduler, runner, check)


def _model(config: EngineConfig, model_dir: Path) -> LlamaModel:
    """The base model in the configured dtype, device and weight layout."""
    layout = config.weight_layout
    if layout == "blocked" and not blocked_layout_available(
        config.torch_dtype, config.torch_device
    ):
        raise ConfigError(
            "weight_layout=blocked needs float32 or bfloat16 on a CPU whose torch has oneDNN"
        )
    blocked = {"auto": None, "blocked": True, "plain": False}[layout]  # None: where available
    rows = None if layout == "auto" else False  # the row kernel's copy: auto alone
    if config.torch_device.type == "cpu" and str(config.torch_dtype) == "torch.float16":
        log.warning(
            "float16 on a CPU runs several times slower than bfloat16 (no native half-precision "
            "matrix products here); --dtype bfloat16 keeps 16-bit memory at full speed"
        )
    return LlamaModel(
        model_dir, config.torch_dtype, config.torch_device, blocked=blocked, rows=rows
    )


def _pool_pages(
    config: EngineConfig, spec: ModelSpec, registry: AdapterRegistry
) -> tuple[int, int]:
    """The cache pool's pages and the pages kept for adapters alone
    (``adapter_memory``)."""
    page_bytes = CachePool.page_bytes(spec, config.block_size, config.torch_dtype)
    try:
        lora_page_elems = CachePool.lora_elements(
            spec, config.block_size, config.torch_dtype, config.torch_lora_dtype
        )
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc

    def found() -> list[int]:  # each adapter's pages, from its weights file's header
        return [
            CachePool.pages_for(layer_elements(registry.require(a).path).values(), lora_page_elems)
            for a in registry
        ]

    size = size_pool(config, page_bytes, max_model_len(config, spec, num_pages=None), found)
    log.info("cache pool %s", size.how)
    num_pages = size.nbytes // page_bytes
    if num_pages < MIN_KV_BLOCKS:
        raise ConfigError(
            f"the cache pool ({size.nbytes} bytes) holds {num_pages} pages of "
            f"{page_bytes} bytes; at least {MIN_KV_BLOCKS} are needed"
        )
    adapter_pages = -(-int(config.adapter_memory or 0) // page_bytes)
    if adapter_pages and num_pages - adapter_pages < MIN_KV_BLOCKS:
        raise ConfigError(
            f"adapter_memory ({config.adapter_memory} bytes) leaves the KV fewer than "
            f"{MIN_KV_BLOCKS} pages of the cache pool's {num_pages}"
        )
    return num_pages, adapter_pages


def _residency(
    config: EngineConfig,
    pages: PagePool,
    registry: AdapterRegistry,
    runner: ModelRunner,
    hooks: Hooks,
    spec: ModelSpec,
) -> Residency:
    """Which adapters the steps compute with: pages in the pool, or weights merged (with a
    static adapter merged for good)."""
    sources = Sources(
        registry,
        HostCache(config.max_cpu_loras),
        AdapterLoader(spec, config.max_lora_rank, config.torch_lora_dtype),
    )
    seats, clock = config.max_loras, config.clock
    if config.lora_mode != "merged":
        quantum_s = config.residency_quantum_ms / 1000
        return ResidencyManager(pages, sources, seats, quantum_s, events=hooks, clock=clock)
    residency = MergedResidency(runner.merge, sources, seats, hooks, clock)
    if config.static_adapter is not None:
        merge_static(residency, config.static_adapter, spec, config)
    return residency


def max_model_len(config: EngineConfig, spec: ModelSpec, num_pages: int | None) -> int:
    """The longest request, prompt and generated tokens: what the model, the pool (when its
    ``num_pages`` are known), the settings and a sliding window allow."""
    limits = [spec.max_position_embeddings]
    if num_pages is not None:
        limits.append(num_pages * config.block_size)
    if config.max_model_len:
        limits.append(config.max_model_len)
    if spec.sliding_window:
        limits.append(spec.sliding_window)
    return min(limits)


def merge_static(
    residency: MergedResidency, adapter_id: str, spec: ModelSpec, config: EngineConfig
) -> None:
    """The static baseline: one adapter merged for good before serving starts (read in
    ``lora_dtype``, so it merges the values the pool would hold)."""
    entry = residency.registry.get(adapter_id)
    if entry is None:
        raise ConfigError(f"static adapter {adapter_id!r} is not among the adapters")
    adapter = read_adapter(
        adapter_id, entry.path, spec, config.max_lora_rank, dtype=config.torch_lora_dtype
    )
    residency.merge_for_good(adapter)


def model_name(model_dir: Path, hf_config: Any) -> str:
    """The base model's name for ``/info``, ``/v1/models`` and responses, never a path: the name
    its manifest or config records (``SmolLM2-135M-Instruct`` of ``HuggingFaceTB/...``), else
    the checkpoint folder's name."""
    from lora_guard.manifest import read_manifest

    manifest = read_manifest(model_dir) or {}
    recorded = manifest.get("info", {}).get("model_id") or getattr(hf_config, "name_or_path", "")
    recorded = str(recorded or "")
    if recorded and not Path(recorded).expanduser().exists() and not recorded.startswith("/"):
        return recorded.rstrip("/").rsplit("/", 1)[-1]
    return model_dir.resolve().name
