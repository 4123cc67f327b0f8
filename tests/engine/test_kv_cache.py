"""The paged KV cache: block bookkeeping, reference counts and prefix caching."""

from __future__ import annotations

from collections.abc import Hashable, Iterator
from pathlib import Path

import pytest
import torch

from lora_guard import LLM, SamplingParams
from lora_guard.engine.kv_cache import Block, BlockManager, KVCache
from lora_guard.engine.sequence import CacheScope, Sequence

NS = ("ns", 1)
OTHER_NS = ("ns", 2)


def make_seq(
    tokens: list[int], namespace: Hashable = NS, request_id: str = "r", scope: str = "w1"
) -> Sequence:
    seq = Sequence(request_id, list(tokens), SamplingParams(), adapter_id=None)
    seq.cache_namespace = namespace
    seq.cache_scope = CacheScope("base", "adapter", scope)
    return seq


def prefill(bm: BlockManager, seq: Sequence) -> None:
    """What the scheduler and engine do for a whole prompt in one step: allocate, grow, compute,
    publish the full blocks."""
    bm.allocate(seq)
    bm.append(seq, seq.num_uncomputed_tokens)
    seq.num_computed_tokens = len(seq.token_ids)
    bm.commit(seq)


def ref_counts(bm: BlockManager) -> list[int]:
    return [b.ref_count for b in bm.blocks]


# allocation and reference counts


def test_allocate_append_free_returns_every_block() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    seq = make_seq(list(range(10)))

    bm.allocate(seq)
    assert seq.block_table == []
    assert seq.num_computed_tokens == 0
    bm.append(seq, 10)
    assert len(seq.block_table) == 3
    assert len(set(seq.block_table)) == 3
    assert bm.num_free_blocks == 5
    assert bm.num_used_blocks == 3

    seq.num_computed_tokens = 10
    for token in (100, 101, 102):  # decode three tokens, one step each
        seq.token_ids.append(token)
        bm.append(seq, 1)
        seq.num_computed_tokens += 1
    assert len(seq.block_table) == 4  # 13 tokens in blocks of 4
    assert bm.num_free_blocks == 4

    bm.free(seq)
    assert seq.block_table == []
    assert seq.num_computed_tokens == 0
    assert bm.num_free_blocks == bm.num_blocks
    assert ref_counts(bm) == [0] * 8


def test_shared_prefix_blocks_are_reference_counted() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    tokens = list(range(10))
    first = make_seq(tokens, request_id="a")
    prefill(bm, first)
    second = make_seq(tokens, request_id="b")

    bm.allocate(second)

    assert second.block_table == first.block_table[:2]
    assert second.num_cached_tokens == 8
    assert second.num_computed_tokens == 8
    assert [bm.blocks[b].ref_count for b in first.block_table] == [2, 2, 1]
    bm.append(second, second.num_uncomputed_tokens)
    assert second.block_table[2] != first.block_table[2]  # the partial block is private
    assert bm.num_used_blocks == 4

    bm.free(first)
    assert bm.num_used_blocks == 3
    assert [bm.blocks[b].ref_count for b in second.block_table] == [1, 1, 1]
    bm.free(second)
    assert bm.num_free_blocks == bm.num_blocks
    assert ref_counts(bm) == [0] * 8


# prefix hits


def test_same_tokens_and_namespace_reuse_the_committed_full_blocks() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    tokens = list(range(20, 30))  # two full blocks and a partial one
    first = make_seq(tokens, request_id="a")
    prefill(bm, first)
    bm.free(first)

    second = make_seq([*tokens, 7], request_id="b")
    bm.allocate(second)

    assert second.num_cached_tokens == 8
    assert second.num_computed_tokens == 8
    assert len(second.block_table) == 2
    assert bm.stats.hit_tokens == 8
    assert bm.stats.queried_tokens == len(tokens) + len(second.token_ids)
    assert bm.stats.copies_on_write == 0
    assert bm.pending_copies == []


def test_hits_stop_at_the_first_differing_block() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    prefill(bm, make_seq(list(range(12)), request_id="a"))

    diverging = make_seq([0, 1, 2, 3, 4, 5, 99, 7, 8, 9, 10, 11, 12], request_id="b")
    bm.allocate(diverging)

    assert diverging.num_cached_tokens == 4
    assert len(diverging.block_table) == 1


def test_a_different_namespace_gets_no_hit() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    tokens = list(range(9))
    prefill(bm, make_seq(tokens, request_id="a"))

    other = make_seq(tokens, OTHER_NS, request_id="b")
    bm.allocate(other)

    assert other.num_cached_tokens == 0
    assert other.num_computed_tokens == 0
    assert other.block_table == []
    assert bm.stats.hit_tokens == 0
    assert bm.stats.conflicts == 0

    same = make_seq(tokens, NS, request_id="c")
    bm.allocate(same)
    assert same.num_cached_tokens == 8


def test_without_prefix_caching_nothing_is_reused() -> None:
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    tokens = list(range(9))
    prefill(bm, make_seq(tokens, request_id="a"))

    again = make_seq(tokens, request_id="b")
    bm.allocate(again)

    assert again.num_cached_tokens == 0
    assert bm.cached == {}


def test_fully_cached_prompt_copies_its_last_block_on_write() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    tokens = list(range(40, 48))  # exactly two blocks
    first = make_seq(tokens, request_id="a")
    prefill(bm, first)
    head, src = first.block_table

    second = make_seq(tokens, request_id="b")
    bm.allocate(second)

    # The last prompt token runs again for its logits: it gets a private copy of the last block.
    assert second.num_computed_tokens == len(tokens) - 1
    assert second.num_cached_tokens == len(tokens) - 1
    assert second.block_table[0] == head
    dst = second.block_table[-1]
    assert dst != src
    assert dst not in first.block_table
    assert bm.pending_copies == [(src, dst)]
    assert bm.stats.copies_on_write == 1
    assert bm.stats.hit_tokens == len(tokens) - 1
    assert bm.blocks[src].ref_count == 1  # only the first sequence holds it now
    assert bm.blocks[dst].ref_count == 1

    # Writing the last token fits in the copied block: no new block is needed.
    assert bm.can_append(second, 1)
    bm.append(second, 1)
    assert len(second.block_table) == 2

    # The shared original stays cached for later requests.
    bm.free(first)
    bm.free(second)
    third = make_seq([*tokens, 1], request_id="c")
    bm.allocate(third)
    assert third.block_table == [head, src]
    assert third.num_cached_tokens == 8


def test_copy_on_write_of_a_freed_prefix_holds_no_extra_references() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    tokens = list(range(8))
    first = make_seq(tokens, request_id="a")
    prefill(bm, first)
    bm.free(first)

    second = make_seq(tokens, request_id="b")
    bm.allocate(second)
    bm.append(second, second.num_uncomputed_tokens)
    assert bm.num_used_blocks == 2
    bm.free(second)

    assert bm.num_free_blocks == bm.num_blocks
    assert ref_counts(bm) == [0] * 4


# eviction order


def test_freed_cached_blocks_are_reused_least_recently_freed_first() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    a_tokens, b_tokens = [1, 2, 3, 4], [5, 6, 7, 8]
    a = make_seq(a_tokens, request_id="a")
    b = make_seq(b_tokens, request_id="b")
    prefill(bm, a)
    prefill(bm, b)
    a_block, b_block = a.block_table[0], b.block_table[0]
    bm.free(a)  # a is freed first, so its block is the first cached one to go
    bm.free(b)

    filler = make_seq(list(range(100, 112)), OTHER_NS, request_id="filler")
    bm.allocate(filler)
    bm.append(filler, 12)

    # The two never-used blocks go first, then a's block; b's block is still free and cached.
    assert a_block in filler.block_table
    assert b_block not in filler.block_table
    assert bm.num_free_blocks == 1
    bm.free(filler)

    a_again = make_seq([*a_tokens, 9], request_id="a2")
    b_again = make_seq([*b_tokens, 9], request_id="b2")
    bm.allocate(a_again)
    bm.allocate(b_again)
    assert a_again.num_cached_tokens == 0  # its cache entry was dropped when the block was reused
    assert b_again.num_cached_tokens == 4
    assert bm.stats.conflicts == 0  # a plain miss, not a refused hit
    assert b_again.block_table == [b_block]


def test_a_sequence_frees_its_tail_first_so_the_prefix_stays_cached_longest() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    tokens = list(range(8))
    first = make_seq(tokens, request_id="a")
    prefill(bm, first)
    head, tail = first.block_table
    bm.free(first)

    filler = make_seq(list(range(50, 62)), OTHER_NS, request_id="filler")
    bm.allocate(filler)
    bm.append(filler, 12)

    assert tail in filler.block_table
    assert head not in filler.block_table
    bm.free(filler)
    again = make_seq([*tokens, 1], request_id="b")
    bm.allocate(again)
    assert again.block_table == [head]
    assert again.num_cached_tokens == 4


# reuse policy


def test_hit_computed_under_other_weights_is_a_conflict_and_refused() -> None:
    # Same namespace key (a policy that forgot the adapter), but the block's KV was computed
    # under other weights: the scope check refuses it.
    bm = BlockManager(num_blocks=8, block_size=4)
    tokens = list(range(9))
    prefill(bm, make_seq(tokens, request_id="a", scope="weights-a"))

    second = make_seq(tokens, request_id="b", scope="weights-b")
    assert bm.can_allocate(second, 100)
    bm.allocate(second)

    assert second.num_cached_tokens == 0
    assert second.block_table == []
    assert bm.stats.conflicts == 1  # can_allocate asks too, but only the admission counts
    assert bm.stats.hit_tokens == 0


def test_may_reuse_decides_scope_mismatches_and_they_are_still_counted() -> None:
    seen: list[tuple[Hashable, Hashable]] = []

    def observe(block: Block, seq: Sequence) -> bool:
        seen.append((block.scope, seq.cache_scope))
        return True

    bm = BlockManager(num_blocks=8, block_size=4)
    tokens = list(range(9))
    prefill(bm, make_seq(tokens, request_id="a", scope="weights-a"))

    second = make_seq(tokens, request_id="b", scope="weights-b")
    bm.allocate(second, observe)

    assert second.num_cached_tokens == 8
    assert bm.stats.conflicts == 2  # one per reused block
    scopes = (
        CacheScope("base", "adapter", "weights-a"),
        CacheScope("base", "adapter", "weights-b"),
    )
    assert seen and all(pair == scopes for pair in seen)


def test_may_reuse_is_not_asked_when_scopes_match() -> None:
    asked: list[int] = []
    bm = BlockManager(num_blocks=8, block_size=4)
    tokens = list(range(9))
    prefill(bm, make_seq(tokens, request_id="a"))

    second = make_seq(tokens, request_id="b")
    bm.allocate(second, lambda block, seq: bool(asked.append(1)))

    assert second.num_cached_tokens == 8
    assert asked == [] and bm.stats.conflicts == 0


def test_may_reuse_can_refuse_part_of_a_prefix() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    tokens = list(range(12))
    first = make_seq(tokens, request_id="a", scope="weights-a")
    prefill(bm, first)
    refused_block = first.block_table[1]

    second = make_seq([*tokens, 1], request_id="b", scope="weights-b")
    bm.allocate(second, lambda block, seq: block.block_id != refused_block)

    assert second.num_cached_tokens == 4
    assert second.block_table == first.block_table[:1]
    assert bm.stats.conflicts == 2


# capacity checks


def test_can_allocate_says_whether_the_pool_holds_the_prompt() -> None:
    bm = BlockManager(num_blocks=2, block_size=4)

    assert bm.can_allocate(make_seq(list(range(8))), 100)
    assert not bm.can_allocate(make_seq(list(range(12))), 100)
    # A chunk of a long prompt fits when the step computes only part of it.
    assert bm.can_allocate(make_seq(list(range(12))), 8)
    assert not bm.can_allocate(make_seq(list(range(12))), 9)

    holder = make_seq(list(range(4)), OTHER_NS, request_id="holder")
    bm.allocate(holder)
    bm.append(holder, 4)
    assert not bm.can_allocate(make_seq(list(range(8))), 100)
    assert bm.can_allocate(make_seq(list(range(4))), 100)


def test_can_allocate_counts_the_copy_on_write_block() -> None:
    tokens = list(range(8))  # two full blocks, cached and freed
    small = BlockManager(num_blocks=2, block_size=4)
    big = BlockManager(num_blocks=3, block_size=4)
    for bm in (small, big):
        first = make_seq(tokens, request_id="a")
        prefill(bm, first)
        bm.free(first)

    # The hit takes both cached blocks; the copy of the last one needs a third.
    assert not small.can_allocate(make_seq(tokens, request_id="b"), 100)
    assert big.can_allocate(make_seq(tokens, request_id="b"), 100)
    # One more token than the cache holds needs no copy, only a block for that token.
    assert not small.can_allocate(make_seq([*tokens, 8], request_id="c"), 100)
    assert big.can_allocate(make_seq([*tokens, 8], request_id="c"), 100)

    second = make_seq(tokens, request_id="b")
    big.allocate(second)
    assert big.num_free_blocks == 1
    assert big.stats.copies_on_write == 1


def test_can_append_says_whether_the_next_tokens_fit() -> None:
    bm = BlockManager(num_blocks=2, block_size=4)
    seq = make_seq(list(range(6)))
    bm.allocate(seq)
    bm.append(seq, 6)
    seq.num_computed_tokens = 6

    assert bm.can_append(seq, 2)  # room left in the second block
    assert not bm.can_append(seq, 3)  # would need a third block
    seq.token_ids.extend([6, 7])
    bm.append(seq, 2)
    seq.num_computed_tokens = 8
    assert not bm.can_append(seq, 1)

    bm.free(seq)
    assert bm.num_free_blocks == 2


# KV tensors


def test_copy_block_copies_keys_and_values_of_one_block() -> None:
    block_size = 4
    cache = KVCache.zeros(
        num_layers=2,
        num_blocks=4,
        block_size=block_size,
        kv_heads=2,
        head_dim=8,
        dtype=torch.float32,
        device=torch.device("cpu"),
    )
    generator = torch.Generator().manual_seed(0)
    cache.k.copy_(torch.randn(cache.k.shape, generator=generator))
    cache.v.copy_(torch.randn(cache.v.shape, generator=generator))
    k_before, v_before = cache.k.clone(), cache.v.clone()

    cache.copy_block(1, 3, block_size)

    src, dst = slice(4, 8), slice(12, 16)
    assert torch.equal(cache.k[:, dst], k_before[:, src])
    assert torch.equal(cache.v[:, dst], v_before[:, src])
    assert not torch.equal(cache.k[:, dst], cache.v[:, dst])
    untouched = slice(0, 12)
    assert torch.equal(cache.k[:, untouched], k_before[:, untouched])
    assert torch.equal(cache.v[:, untouched], v_before[:, untouched])
    assert cache.nbytes() == KVCache.bytes_per_block(2, block_size, 2, 8, torch.float32) * 4


@pytest.fixture(scope="module")
def llm(tiny_model: Path) -> Iterator[LLM]:
    engine = LLM(tiny_model, kv_cache_memory="4MiB")
    yield engine
    engine.engine.shutdown()


@pytest.mark.parametrize(("prompt_len", "cached"), [(16, 15), (21, 16)])
def test_engine_reuses_a_cached_prompt_with_the_same_output(
    llm: LLM, prompt_len: int, cached: int
) -> None:
    prompt = [(7 * i + prompt_len) % 300 + 3 for i in range(prompt_len)]
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)

    first = llm.generate(prompt, params)[0]
    again = llm.generate(prompt, params)[0]
    both = llm.generate([prompt, prompt], params)

    assert first.num_cached_tokens == 0
    assert again.num_cached_tokens == cached
    assert again.token_ids == first.token_ids
    assert again.logprobs == pytest.approx(first.logprobs, abs=1e-4)
    for out in both:
        assert out.num_cached_tokens == cached
        assert out.token_ids == first.token_ids
    if cached == prompt_len - 1:
        assert llm.engine.blocks.stats.copies_on_write >= 3
    llm.engine.check_no_leaks()
