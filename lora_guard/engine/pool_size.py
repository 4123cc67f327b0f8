"""How large the cache pool is: the size given, or what the configured work needs.

A GPU server owns its device and vLLM fills a share of it with KV; a CPU server shares its host,
so without ``--cache-memory`` the pool here is what the settings ask for: KV for
``max_num_seqs`` requests of the longest context, plus the pages of ``max_loras`` adapters (every
adapter found, up to ``max_cpu_loras``, when there is no seat cap) as large as the largest one
found, never more than a quarter of the memory free at start. Either way its memory is committed
as the cache uses it (:func:`lora_guard.engine.lora.pool.zeroed`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from lora_guard.engine.config import EngineConfig
from lora_guard.engine.values import DEFAULT_CACHE_SHARE, free_memory

GiB, MiB = 2**30, 2**20


@dataclass(frozen=True, slots=True)
class PoolSize:
    nbytes: int
    how: str  # how it was chosen, for the start-up log


def size_pool(
    config: EngineConfig,
    page_bytes: int,
    context: int,
    adapter_pages: Callable[[], Sequence[int]],
) -> PoolSize:
    """The pool's bytes: the size set, else the need of ``config.max_num_seqs`` requests of
    ``context`` tokens and of the adapters found (``adapter_pages()``: each one's pages, read
    only when no size is set), capped by a share of free memory."""
    given = config.cache_bytes()
    if given is not None:
        return PoolSize(given, f"{show(given)}, as set")
    found = adapter_pages()
    seats = config.max_loras or min(len(found), config.max_cpu_loras)
    kv = config.max_num_seqs * -(-context // config.block_size) * page_bytes
    adapters = seats * max(found, default=0) * page_bytes
    need = kv + adapters
    why = (
        f"KV for {config.max_num_seqs} requests of {context} tokens ({show(kv)}) and "
        f"{seats} adapters of the largest found ({show(adapters)})"
    )
    free = free_memory(config.torch_device)
    cap = int(free * DEFAULT_CACHE_SHARE)
    if need <= cap:
        return PoolSize(need, f"{show(need)}: {why}")
    return PoolSize(
        cap,
        f"{show(cap)}, a quarter of the {show(free)} free: {why} would take {show(need)}; "
        f"--cache-memory, --max-num-seqs or --max-total-tokens set it",
    )


def show(nbytes: int) -> str:
    return f"{nbytes / GiB:.2f} GiB" if nbytes >= GiB else f"{nbytes / MiB:.1f} MiB"
