"""The cache pool's size: what was set, else what the settings and the adapters found need,
capped by a quarter of free memory; its memory committed as the cache uses it."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from lora_guard.demo.testing import AdapterFactory
from lora_guard.engine import LLM
from lora_guard.engine.config import EngineConfig
from lora_guard.engine.lora.checkpoint import layer_elements
from lora_guard.engine.lora.pool import CachePool, zeroed
from lora_guard.engine.pool_size import size_pool
from lora_guard.engine.sampling import SamplingParams
from lora_guard.engine.values import DEFAULT_CACHE_SHARE, free_memory

BLOCK = 4


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_without_a_size_the_pool_holds_the_batch_at_full_context_and_the_adapters(
    tiny_model: Path, tiny_adapters: AdapterFactory, caplog: pytest.LogCaptureFixture
) -> None:
    adapters = tiny_adapters(3, "sized", ranks=(4, 8, 16))
    with caplog.at_level(logging.INFO, logger="lora_guard.engine.builder"):
        llm = LLM(
            tiny_model,
            adapters=adapters,
            block_size=BLOCK,
            max_num_seqs=3,
            max_model_len=64,
            max_loras=2,
        )
    engine = llm.engine
    spec = engine.model.spec
    page_bytes = CachePool.page_bytes(spec, BLOCK, torch.float32)
    # every adapter loaded: the largest one's pages are what the header said
    params = SamplingParams(max_new_tokens=2, ignore_eos=True)
    pages = {}
    for adapter_id, path in adapters.items():
        llm.generate([5, 6, 7], params, adapter_id)
        entry = engine.adapters.current(adapter_id)
        assert entry is not None
        pages[adapter_id] = entry.num_pages
        header = CachePool.pages_for(layer_elements(path).values(), engine.pool.lora_page_elems)
        assert header == entry.num_pages
    expected = (3 * 64 // BLOCK + 2 * max(pages.values())) * page_bytes
    assert engine.pool.nbytes() == expected
    assert "KV for 3 requests of 64 tokens" in caplog.text


def test_a_size_set_is_the_size(tiny_model: Path) -> None:
    llm = LLM(tiny_model, cache_memory="1MiB", block_size=BLOCK)
    page_bytes = CachePool.page_bytes(llm.engine.model.spec, BLOCK, torch.float32)
    assert llm.engine.pool.nbytes() == 2**20 // page_bytes * page_bytes


def test_a_need_beyond_a_quarter_of_free_memory_is_capped() -> None:
    config = EngineConfig(model="unused", max_num_seqs=10**6, device="cpu")
    size = size_pool(config, page_bytes=2**20, context=8192, adapter_pages=lambda: [3, 5])
    assert 0 < size.nbytes <= free_memory(torch.device("cpu")) * DEFAULT_CACHE_SHARE
    assert "a quarter of the" in size.how and "--cache-memory" in size.how


def test_the_pool_takes_memory_as_the_cache_uses_it() -> None:
    before = resident_bytes()
    arena = zeroed((2, 2, 4096, 16384), torch.float32, torch.device("cpu"))  # 1 GiB
    assert resident_bytes() - before < 64 * 2**20
    assert not arena[:, :, ::997].any()  # zero where read
    arena[:, :, :16].fill_(1.0)
    assert resident_bytes() - before < 64 * 2**20 + 2 * 2 * 16 * 16384 * 4
