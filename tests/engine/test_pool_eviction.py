"""The pool's one eviction choice (``plugins/eviction.py``): cached prefix blocks and idle
adapters weighed in one order, by the ``lora_guard_cache_evict`` hook or the engine's default
(least recently used over both kinds); adapters kept apart when ``adapter_memory`` is set."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest

from lora_guard import LLM, SamplingParams
from lora_guard.bench.virtual.replay import VirtualClock
from lora_guard.demo.testing import AdapterFactory
from lora_guard.engine.cost_meter import Line
from lora_guard.engine.values import ConfigError
from lora_guard.plugins import hookimpl
from lora_guard.plugins.eviction import ADAPTER, PREFIX, Candidate, choose, lru

PAGE_BYTES = (
    2 * 2 * 16 * 2 * 16 * 4
)  # tiny model, 16-token pages: layers, k/v, tokens, heads, dim, 4


def block(page: int, last_used: float, depth: int = 0) -> Candidate:
    return Candidate(PREFIX, page, 1, last_used, depth=depth)


def adapter(seat: int, last_used: float, pages: int = 4) -> Candidate:
    return Candidate(ADAPTER, seat, pages, last_used, adapter_id=f"a{seat}")


def test_the_default_is_least_recently_used_over_both_kinds() -> None:
    old_adapter, new_block, old_block = adapter(0, 1.0), block(7, 5.0), block(8, 0.5)
    tail = block(9, 5.0, depth=3)
    assert lru([new_block, old_adapter, old_block, tail]) == [
        old_block,
        old_adapter,
        tail,
        new_block,
    ]
    # Two pages short: the oldest block, then the adapter (its four pages cover the rest).
    assert choose([new_block, old_adapter, old_block], 2, None) == [old_block, old_adapter]


def test_a_plugin_order_is_followed_and_what_it_leaves_out_stays() -> None:
    candidates = [adapter(0, 1.0), block(7, 5.0), block(8, 0.5)]

    def blocks_only(offered: Sequence[Candidate]) -> list[Candidate]:
        return [c for c in offered if c.kind == PREFIX][::-1]

    assert choose(candidates, 3, blocks_only) == [candidates[2], candidates[1]]
    # A plugin that answers None leaves it to the default.
    assert choose(candidates, 1, lambda offered: None) == [candidates[2]]
    # Nothing short, nothing leaves.
    assert choose(candidates, 0, blocks_only) == []


def test_a_cost_line_learns_its_slope_and_keeps_its_prior_until_it_can() -> None:
    line = Line((10.0, 1.0))
    line.add(100, 230.0)
    assert line.coefficients() == (10.0, 1.0)  # one point: no slope yet
    for tokens in (0, 50, 200, 400):
        line.add(tokens, 30.0 + 2.0 * tokens)
    a, b = line.coefficients()
    assert b == pytest.approx(2.0, rel=0.05) and a > 0


class Order:
    """Orders the pool's candidates one kind first, and keeps what it was offered."""

    def __init__(self, first: str) -> None:
        self.first, self.offers = first, list[list[Candidate]]()

    @hookimpl
    def lora_guard_cache_evict(self, candidates: Sequence[Candidate]) -> list[Candidate]:
        self.offers.append(list(candidates))
        return sorted(candidates, key=lambda c: (c.kind != self.first, c.last_used))


def run_pool(tiny_model: Path, adapters: dict[str, Path], first: str | None) -> tuple[LLM, Order]:
    """The one adapter serves a request, then leaves idle; then long prompts of the base model fill
    the pool with cached blocks until KV must take pages from something."""
    clock = VirtualClock()
    llm = LLM(
        tiny_model,
        adapters=adapters,
        block_size=16,
        kv_cache_memory=40 * PAGE_BYTES,
        policies="lru",
        clock=clock,
    )
    order = Order(first or "")
    if first is not None:
        llm.engine.hooks.pm.register(order)
    params = SamplingParams(max_new_tokens=1, ignore_eos=True)
    llm.generate([[5, 6, 7, 8]], params, adapter_ids=list(adapters))
    for i in range(20):  # 60 blocks through a pool of 40 pages
        clock.now += 1.0
        prompt = [100 + 7 * i + j for j in range(48)]  # three blocks each, none shared
        llm.generate([prompt], params)
    return llm, order


@pytest.fixture(scope="module")
def one_adapter(tiny_adapters: AdapterFactory) -> dict[str, Path]:
    return tiny_adapters(n=1, prefix="a", ranks=(8,))


def test_kv_takes_an_idle_adapters_pages_or_old_blocks_as_the_order_says(
    tiny_model: Path, one_adapter: dict[str, Path]
) -> None:
    # Blocks first: the adapter stays, the oldest prompts' blocks go.
    llm, order = run_pool(tiny_model, one_adapter, PREFIX)
    assert list(one_adapter) == list(llm.engine.figures().resident)
    assert order.offers and {c.kind for c in order.offers[0]} == {ADAPTER, PREFIX}
    offered = order.offers[0]
    assert all(c.restore_ms > 0 for c in offered)
    llm.engine.check_no_leaks()
    # Adapters first: the idle adapter gives its pages to the KV.
    llm, order = run_pool(tiny_model, one_adapter, ADAPTER)
    assert not llm.engine.figures().resident
    llm.engine.check_no_leaks()


def test_the_default_lets_a_long_idle_adapter_leave_before_recent_blocks(
    tiny_model: Path, one_adapter: dict[str, Path]
) -> None:
    llm, _ = run_pool(tiny_model, one_adapter, None)
    # The adapter was used at the start; every cached block since is newer: S-LoRA's LRU takes
    # the adapter first.
    assert not llm.engine.figures().resident
    assert llm.engine.blocks.stats.hit_tokens == 0
    llm.engine.check_no_leaks()


def test_adapter_memory_keeps_the_kv_out_of_the_adapters_pages(
    tiny_model: Path, tiny_adapters: AdapterFactory
) -> None:
    adapters = tiny_adapters(n=3, prefix="m", ranks=(8,))
    clock = VirtualClock()
    llm = LLM(
        tiny_model,
        adapters=adapters,
        block_size=16,
        cache_memory=48 * PAGE_BYTES,
        adapter_memory=16 * PAGE_BYTES,
        max_loras=2,
        policies="lru",
        clock=clock,
    )
    blocks = llm.engine.blocks
    assert blocks.kv_pages == 32
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    prompts = [[200 + 5 * i + j for j in range(40)] for i in range(12)]
    names = sorted(adapters)
    outs = llm.generate(prompts, params, adapter_ids=[names[i % 3] for i in range(12)])
    assert all(len(o.token_ids) == 4 for o in outs)
    assert blocks.num_kv_pages <= 32 and len(blocks.reserved) <= 16
    llm.engine.check_no_leaks()
    with pytest.raises(ConfigError, match="adapter_memory"):
        LLM(tiny_model, cache_memory=48 * PAGE_BYTES, adapter_memory=46 * PAGE_BYTES)
