"""The cache pool and step-level residency: rank-exact pages under one budget with KV, parked
requests and rotation, reloads under load, and the two LoRA computations agreeing."""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from lora_guard import LLM, SamplingParams
from lora_guard.demo.testing import AdapterFactory, SoloGreedy
from lora_guard.engine.llm_engine import LLMEngine
from lora_guard.engine.lora import read_adapter
from lora_guard.engine.lora.compute import LoraBatch, LoraSegment
from lora_guard.engine.outputs import RequestOutput
from lora_guard.plugins import hookimpl

NUM_ADAPTERS = 7
PAGE_BYTES = 2 * 2 * 4 * 2 * 16 * 4  # layers * k/v * block tokens * kv heads * head dim * fp32


@pytest.fixture(scope="module")
def adapters(tiny_adapters: AdapterFactory) -> dict[str, Path]:
    return tiny_adapters(n=NUM_ADAPTERS, prefix="r", ranks=(2, 4, 8))


class Evictions:
    def __init__(self) -> None:
        self.evicted: list[str] = []

    @hookimpl
    def lora_guard_adapter_evicted(self, adapter_id: str) -> None:
        self.evicted.append(adapter_id)


def check_pool(engine: LLMEngine) -> None:
    """The pool's bookkeeping holds together: adapters packed at the bottom without holes, KV
    blocks never in an adapter's pages, every page counted once."""
    residency, blocks = engine.adapters, engine.blocks
    runs = sorted((e.first_page, e.num_pages) for e in residency.residents())
    at = 0
    for first, n in runs:
        assert first == at, f"a hole or an overlap at page {at}: {runs}"
        at += n
    pages = engine.scheduler.pages
    assert at == pages.top
    assert sorted((r.first_page, r.num_pages) for r in pages.runs) == runs
    assert blocks.reserved == set(range(pages.top))
    for seq in engine.scheduler.running:
        assert not set(seq.block_table) & blocks.reserved, "a KV block sits in adapter pages"
    used = blocks.num_blocks - blocks.num_free_blocks - len(blocks.reserved)
    assert used == blocks.num_used_blocks >= 0
    page_bytes = engine.pool.page_bytes(engine.model.spec, blocks.block_size, torch.float32)
    assert engine.pool.nbytes() == blocks.num_blocks * page_bytes <= engine.config.cache_bytes()


def drive(engine: LLMEngine, max_steps: int = 5000) -> dict[str, RequestOutput]:
    finished: dict[str, RequestOutput] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            break
        outputs = engine.step()
        check_pool(engine)
        finished.update((o.request_id, o) for o in outputs if o.finished)
        if not outputs:
            time.sleep(0.002)  # an adapter is being read
    assert not engine.has_unfinished_requests(), "requests never finished"
    return finished


# the pool


def test_an_adapter_takes_exactly_its_ranks(tiny_model: Path, tmp_path: Path) -> None:
    base = AutoModelForCausalLM.from_pretrained(tiny_model)
    config = LoraConfig(
        r=4,
        target_modules=["q_proj", "k_proj", "v_proj", "up_proj"],
        rank_pattern={"k_proj": 2, "up_proj": 8},
        init_lora_weights=False,
    )
    torch.manual_seed(1)
    get_peft_model(base, config).save_pretrained(str(tmp_path / "mixed"))
    llm = LLM(
        tiny_model,
        adapters={"mixed": tmp_path / "mixed"},
        cache_memory=64 * PAGE_BYTES,
        block_size=4,
        max_lora_rank=64,
    )
    engine = llm.engine
    adapter = read_adapter("mixed", tmp_path / "mixed", engine.model.spec, 64)
    layout = engine.pool.layout(adapter)
    exact = sum(a.numel() + b.numel() for a, b in adapter.weights.values()) * 4
    assert layout.nbytes == exact  # q 4, k 2, v 4, up 8 rows: nothing padded to rank 64
    # Per layer: A = 10 rows of 64 + 8 of 64, B = 4*64 + 2*32 + 4*32 + 8*128 columns-by-rank.
    page_elems = 4 * 2 * 16
    assert layout.num_pages == -(-max(18 * 64, 4 * 64 + 2 * 32 + 4 * 32 + 8 * 128) // page_elems)

    arena = engine.pool.arena.data_ptr(), engine.pool.nbytes()
    params = SamplingParams(max_new_tokens=3, ignore_eos=True)
    assert llm.generate([5, 6, 7, 8], params, "mixed")[0].finish_reason == "length"
    entry = engine.adapters.current("mixed")
    assert entry is not None and entry.num_pages == layout.num_pages
    for layer, weights in enumerate(entry.layers):
        qkv = weights["qkv"]
        a_q = adapter.weights[layer, "q_proj"][0]
        a_k, b_k = adapter.weights[layer, "k_proj"]
        assert torch.equal(qkv.a, torch.cat([a_q, a_k, adapter.weights[layer, "v_proj"][0]]))
        assert [p.bt.shape for p in qkv.parts] == [(4, 64), (2, 32), (4, 32)]
        assert torch.equal(qkv.parts[1].bt, b_k.T)
        assert set(weights) == {"qkv", "gate_up"} and len(weights["gate_up"].parts) == 1
    assert (engine.pool.arena.data_ptr(), engine.pool.nbytes()) == arena  # a copy, no allocation
    engine.check_no_leaks()


def test_the_two_lora_computations_agree() -> None:
    torch.manual_seed(0)
    from lora_guard.engine.lora.pool import ModulePart, ProjectionWeights

    def weights(rank_q: int, rank_v: int) -> list[dict[str, ProjectionWeights]]:
        a = torch.randn(rank_q + rank_v, 16)
        parts = (
            ModulePart(0, rank_q, 0, 16, torch.randn(rank_q, 16)),
            ModulePart(rank_q, rank_q + rank_v, 24, 32, torch.randn(rank_v, 8)),
        )
        return [{"qkv": ProjectionWeights(a, parts)}]

    x = torch.randn(11, 16)
    segments = [
        LoraSegment(1, 4, weights(4, 2)),
        LoraSegment(4, 5, weights(8, 8)),
        LoraSegment(7, 11, weights(2, 1)),
    ]
    base = torch.randn(11, 32)
    looped, batched = base.clone(), base.clone()
    LoraBatch(segments, "loop").apply(x, looped, 0, "qkv")
    LoraBatch(segments, "batched").apply(x, batched, 0, "qkv")
    assert torch.allclose(looped, batched, atol=1e-5)
    assert torch.equal(looped[[0, 5, 6]], base[[0, 5, 6]])  # tokens of no adapter untouched
    assert not torch.equal(looped[1:5], base[1:5])
    LoraBatch(segments, "loop").apply(x, base, 0, "o")  # no weights for o: nothing changes
    assert torch.equal(base, base)


def test_batched_computation_matches_the_loop_token_for_token(
    tiny_model: Path, adapters: dict[str, Path], solo: Any
) -> None:
    names = sorted(adapters)
    prompts = [[5, 6, 7, 8, 9 + i] for i in range(8)]
    ids = [None if i % 4 == 0 else names[i % len(names)] for i in range(8)]
    llm = LLM(tiny_model, adapters=adapters, cache_memory="4MiB", lora_compute="batched")
    outs = llm.generate(prompts, SamplingParams(max_new_tokens=6, ignore_eos=True), ids)
    for prompt, adapter, out in zip(prompts, ids, outs, strict=True):
        assert out.token_ids == solo(prompt, adapter, 6), adapter


# residency per step


def test_a_short_request_for_a_seventh_adapter_does_not_wait_for_the_long_ones(
    tiny_model: Path, adapters: dict[str, Path], solo: Any
) -> None:
    # Two seats, six long requests on six adapters, then a short one for a seventh adapter: the
    # adapters rotate at step boundaries, so the short request finishes long before any long one.
    # The default policies: with every seat busy, hot-set lets adapters take turns at the quantum.
    names = sorted(adapters)
    llm = LLM(
        tiny_model,
        adapters=adapters,
        max_loras=2,
        cache_memory="4MiB",
        residency_quantum_ms=20,
    )
    engine = llm.engine
    long = SamplingParams(max_new_tokens=120, ignore_eos=True)
    for i in range(6):
        engine.add_request(f"long-{i}", [5, 6, 7, 10 + i], long, names[i])
    for _ in range(3):
        engine.step()
    engine.add_request(
        "short", [5, 6, 7, 30], SamplingParams(max_new_tokens=4, ignore_eos=True), names[6]
    )
    progress = dict.fromkeys((f"long-{i}" for i in range(6)), 0)  # tokens each long one has
    done_at: dict[str, int] = {}
    for _ in range(20000):
        if not engine.has_unfinished_requests():
            break
        outputs = engine.step()
        for out in outputs:
            if out.request_id in progress:
                progress[out.request_id] = len(out.token_ids)
            if out.finished:
                assert out.finish_reason == "length", out.error
                done_at[out.request_id] = sum(progress.values())
        check_pool(engine)
        if not outputs:
            time.sleep(0.001)  # an adapter is being read
    # When the short one finished, the long ones together had less than a fifth of their tokens.
    print(f"the long requests had {done_at['short']} of {6 * 120} tokens when the short one ended")
    assert done_at["short"] < 6 * 120 / 5
    assert min(done_at[f"long-{i}"] for i in range(6)) > done_at["short"]
    assert engine.adapters.stats.evictions >= 6  # they took turns
    engine.check_no_leaks()


@settings(
    max_examples=25,
    deadline=None,
    print_blob=True,  # a failure prints the @reproduce_failure line; keep it as an @example
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    stream=st.lists(
        st.tuples(
            st.integers(0, 10),  # arrival step
            st.one_of(st.none(), st.integers(0, NUM_ADAPTERS - 1)),  # adapter
            st.integers(0, 2),  # which shared prefix
            st.integers(1, 12),  # max_new_tokens
            st.booleans(),  # aborted after a few steps
        ),
        min_size=1,
        max_size=16,
    ),
    seats=st.integers(0, 4),  # 0: no seat cap, the pages alone decide
    pages=st.sampled_from([40, 64, 160]),  # the largest adapter here takes 32
    pin_first=st.booleans(),
)
def test_the_pool_never_leaks_overflows_or_drifts(
    tiny_model: Path,
    adapters: dict[str, Path],
    solo: Any,
    stream: list[Any],
    seats: int,
    pages: int,
    pin_first: bool,
) -> None:
    names = sorted(adapters)
    pinned = [names[0]] if pin_first and seats != 1 else []
    llm = LLM(
        tiny_model,
        adapters=adapters,
        max_loras=seats,
        max_cpu_loras=seats or NUM_ADAPTERS,
        block_size=4,
        cache_memory=pages * PAGE_BYTES,
        residency_quantum_ms=5,
        settings={"pin": pinned, "cold_loads_per_minute": 1000},
    )
    engine = llm.engine
    evictions = Evictions()
    engine.hooks.pm.register(evictions)
    prefixes = [[5, 6, 7, 8, 9, 10, 11, 12], [5, 6, 7, 8, 20], [30, 31]]
    requests = {
        f"q{i}": (arrival, [*prefixes[prefix], 40 + i], None if a is None else names[a], n, abort)
        for i, (arrival, a, prefix, n, abort) in enumerate(stream)
    }
    finished: dict[str, RequestOutput] = {}
    for step in range(5000):
        for rid, (arrival, prompt, adapter, n, abort) in requests.items():
            if arrival == step:
                params = SamplingParams(max_new_tokens=n, ignore_eos=True)
                engine.add_request(rid, prompt, params, adapter)
            if abort and step == arrival + 3 and rid not in finished:
                out = engine.abort(rid)
                if out is not None:
                    finished[rid] = out
        outputs = engine.step()
        check_pool(engine)
        finished.update((o.request_id, o) for o in outputs if o.finished)
        if len(finished) == len(requests):
            break
        if not outputs:
            time.sleep(0.001)
    assert len(finished) == len(requests), "a request was lost"
    for rid, out in finished.items():
        _, prompt, adapter, n, _ = requests[rid]
        if out.finish_reason == "abort":
            continue
        assert out.error is None, out.error
        assert out.token_ids == solo(prompt, adapter, n), f"{rid} ({adapter}) drifted"
    assert not set(evictions.evicted) & set(pinned), "a pinned adapter was evicted"
    engine.check_no_leaks()
    engine.shutdown()


def test_a_reload_under_load_never_mixes_versions(
    tiny_model: Path, adapters: dict[str, Path], solo: Any
) -> None:
    # Requests that started under r-00's old weights finish under them, requests that come after
    # the reload get the new ones, and r-01's requests rotate through the seats meanwhile.
    names = sorted(adapters)
    old, new = names[0], names[1]
    table = {old: adapters[old], new: adapters[new], "other": adapters[names[2]]}
    llm = LLM(tiny_model, adapters=table, max_loras=2, cache_memory="4MiB", residency_quantum_ms=5)
    engine = llm.engine
    long = SamplingParams(max_new_tokens=30, ignore_eos=True)
    prompt = [5, 6, 7, 8, 9]
    engine.add_request("before", prompt, long, old)
    engine.add_request("other-1", prompt, long, "other")
    started: dict[str, int] = {}
    while started.get("before", 0) < 3:  # "before" computes under the old weights
        started.update((o.request_id, len(o.token_ids)) for o in engine.step())
        time.sleep(0.001)
    llm.add_adapter(old, adapters[new])  # same id, the other folder's weights
    engine.add_request("after", prompt, long, old)
    engine.add_request("other-2", [5, 6, 7, 8, 10], long, "other")
    finished = drive(engine)
    assert finished["before"].token_ids == solo(prompt, old, 30)
    assert finished["after"].token_ids == solo(prompt, new, 30)
    assert finished["other-1"].token_ids == solo(prompt, names[2], 30)
    assert finished["other-2"].token_ids == solo([5, 6, 7, 8, 10], names[2], 30)
    assert engine.blocks.stats.conflicts == 0
    engine.check_no_leaks()


def test_an_adapter_changed_on_disk_is_read_again_for_new_requests(
    tiny_model: Path, adapters: dict[str, Path], solo: Any, tmp_path: Path
) -> None:
    # Someone copies new weights over a served adapter's folder: the request that started before
    # finishes under the old weights, the next ones get the new, and the change is counted.
    names = sorted(adapters)
    folder = tmp_path / "tenant-a"
    shutil.copytree(adapters[names[0]], folder)
    llm = LLM(tiny_model, adapters={"tenant-a": folder}, max_loras=2, cache_memory="4MiB")
    engine = llm.engine
    long = SamplingParams(max_new_tokens=20, ignore_eos=True)
    prompt = [5, 6, 7, 8, 9]
    engine.add_request("before", prompt, long, "tenant-a")
    started = 0
    while started < 3:
        started += sum(len(o.token_ids) > 0 for o in engine.step() if o.request_id == "before")
        time.sleep(0.001)
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        shutil.copyfile(adapters[names[1]] / name, folder / name)
    engine.add_request("after", prompt, long, "tenant-a")
    finished = drive(engine)
    assert finished["before"].token_ids == solo(prompt, names[0], 20)
    assert finished["after"].token_ids == solo(prompt, names[1], 20)
    assert engine.adapters.stats.changed_on_disk == 1
    engine.add_request("again", prompt, long, "tenant-a")  # unchanged since: no second read
    assert drive(engine)["again"].token_ids == finished["after"].token_ids
    assert engine.adapters.stats.changed_on_disk == 1
    engine.check_no_leaks()


def test_with_no_seat_cap_the_pool_pages_alone_decide_what_is_resident(
    tiny_model: Path, adapters: dict[str, Path], solo: Any
) -> None:
    names = sorted(adapters)
    prompts = [[5, 6, 7, 10 + i] for i in range(2 * NUM_ADAPTERS)]
    ids = [names[i % NUM_ADAPTERS] for i in range(len(prompts))]
    params = SamplingParams(max_new_tokens=3, ignore_eos=True)
    # A pool with room for every adapter: all of them resident at once, none evicted.
    roomy = LLM(tiny_model, adapters=adapters, cache_memory="4MiB", block_size=4)
    outs = roomy.generate(prompts, params, ids)
    stats = roomy.engine.adapters.stats
    assert (stats.peak_resident, stats.evictions) == (NUM_ADAPTERS, 0)
    # A pool with pages for only some of them: they take turns, and the answers hold.
    tight = LLM(
        tiny_model,
        adapters=adapters,
        cache_memory=40 * PAGE_BYTES,
        block_size=4,
        residency_quantum_ms=5,
    )
    evictions = Evictions()
    tight.engine.hooks.pm.register(evictions)
    assert [o.token_ids for o in tight.generate(prompts, params, ids)] == [
        o.token_ids for o in outs
    ]
    assert outs[0].token_ids == solo(prompts[0], ids[0], 3)
    assert evictions.evicted and tight.engine.adapters.stats.peak_resident < NUM_ADAPTERS
    for llm in (roomy, tight):
        llm.engine.check_no_leaks()


def test_generate_answers_every_prompt_over_more_adapters_than_the_cold_budget(
    tiny_model: Path, adapters: dict[str, Path]
) -> None:
    # Eight adapters read from disk in a burst with the default policies (a budget of 6 per
    # minute): loads into free memory are free, and the batch never drops a prompt for a policy.
    names = sorted(adapters)
    extra = {f"copy-{i}": adapters[names[i]] for i in range(8 - len(names))}
    table = {**adapters, **extra}
    llm = LLM(tiny_model, adapters=table, cache_memory="4MiB")
    ids = [sorted(table)[i % 8] for i in range(32)]
    outs = llm.generate(
        [[5, 6, 7, 10 + i] for i in range(32)],
        SamplingParams(max_new_tokens=4, ignore_eos=True),
        ids,
    )
    assert [o.finish_reason for o in outs] == ["length"] * 32, [o.error for o in outs if o.error]
    llm.engine.check_no_leaks()


def test_bfloat16_keeps_adapter_pages_in_bfloat16_and_serves(
    tiny_model: Path, adapters: dict[str, Path]
) -> None:
    names = sorted(adapters)
    llm = LLM(tiny_model, adapters=adapters, cache_memory="4MiB", dtype="bfloat16", max_loras=2)
    assert llm.engine.pool.arena.dtype == torch.bfloat16
    prompts = [[5, 6, 7, 8, 9 + i] for i in range(6)]
    ids = [None, *names[:5]]
    outs = llm.generate(prompts, SamplingParams(max_new_tokens=5, ignore_eos=True), ids)
    assert [o.finish_reason for o in outs] == ["length"] * 6
    entry = llm.engine.adapters.residents()[0]
    adapter = read_adapter(entry.adapter_id, adapters[entry.adapter_id], llm.engine.model.spec, 64)
    qkv = entry.layers[0]["qkv"]
    a_q = adapter.weights[0, "q_proj"][0]
    assert qkv.a.dtype == torch.bfloat16
    assert torch.allclose(qkv.a[: a_q.shape[0]].float(), a_q, rtol=1e-2, atol=1e-2)
    llm.engine.check_no_leaks()


def test_bfloat16_adapter_pages_beside_float32_kv_take_half_the_pages_and_match_solo_runs(
    tiny_model: Path, adapters: dict[str, Path]
) -> None:
    names = sorted(adapters)
    pools = {}
    for lora_dtype in ("float32", "bfloat16"):
        pools[lora_dtype] = LLM(
            tiny_model,
            adapters=adapters,
            cache_memory=64 * PAGE_BYTES,
            block_size=4,
            lora_dtype=lora_dtype,
        ).engine
    path = adapters[names[-1]]
    read = {
        d: read_adapter(names[-1], path, e.model.spec, 64, dtype=e.pool.lora_dtype)
        for d, e in pools.items()
    }
    wide, narrow = (pools[d].pool.layout(read[d]) for d in ("float32", "bfloat16"))
    assert narrow.nbytes * 2 == wide.nbytes
    assert narrow.num_pages == -(-wide.num_pages // 2)
    pairs = zip(read["float32"].weights.values(), read["bfloat16"].weights.values(), strict=True)
    for a32, a16 in pairs:
        assert torch.equal(a16[0], a32[0].to(torch.bfloat16))  # rounded once, when read
        assert torch.equal(a16[1], a32[1].to(torch.bfloat16))
    for engine in pools.values():
        engine.shutdown()

    # Seats for two of seven adapters, prefix caching on: adapters rotate, move down the pool
    # and share it with float32 KV; every request still gets the tokens of its solo run.
    solo = SoloGreedy(tiny_model, adapters, lora_dtype="bfloat16")
    llm = LLM(
        tiny_model,
        adapters=adapters,
        cache_memory="4MiB",
        max_loras=2,
        lora_dtype="bfloat16",
        residency_quantum_ms=5,
    )
    assert llm.engine.pool.arena.dtype == torch.float32
    assert llm.engine.runner.lora_mode == "kernel"  # the solo runs use the loop
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 40 + i] for i in range(14)]
    ids = [None if i % 7 == 0 else names[i % len(names)] for i in range(14)]
    outs = llm.generate(prompts, SamplingParams(max_new_tokens=6, ignore_eos=True), ids)
    for prompt, adapter, out in zip(prompts, ids, outs, strict=True):
        assert out.token_ids == solo(prompt, adapter, 6), adapter
    entry = llm.engine.adapters.residents()[0]
    assert entry.layers[0]["qkv"].a.dtype == torch.bfloat16
    llm.engine.check_no_leaks()
    llm.engine.shutdown()
    solo.close()
