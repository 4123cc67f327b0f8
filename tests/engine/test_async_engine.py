"""The async side: token streams per request, abort frees blocks, concurrent requests."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from lora_guard import LLM, SamplingParams
from lora_guard.engine import UnknownAdapterError
from lora_guard.engine.async_engine import AsyncEngine


@pytest.fixture(scope="module")
def engine(tiny_model: Path) -> Iterator[AsyncEngine]:
    llm = LLM(tiny_model, kv_cache_memory="4MiB", block_size=4)
    async_engine = AsyncEngine(llm.engine)
    async_engine.start()
    yield async_engine
    async_engine.shutdown()


def test_stream_grows_one_token_at_a_time_and_matches_offline(
    engine: AsyncEngine, tiny_model: Path
) -> None:
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)

    async def collect() -> list[list[int]]:
        return [list(out.token_ids) async for out in engine.generate("The capital", params)]

    states = asyncio.run(collect())
    assert [len(s) for s in states] == list(range(1, 9))
    offline = LLM(tiny_model, kv_cache_memory="4MiB").generate("The capital", params)[0]
    assert states[-1] == offline.token_ids


def test_concurrent_streams_all_finish(engine: AsyncEngine) -> None:
    async def one(i: int) -> int:
        params = SamplingParams(max_new_tokens=4 + i, ignore_eos=True)
        last = None
        async for out in engine.generate(f"Tenants send request {i}", params):
            last = out
        assert last is not None and last.finished
        return len(last.token_ids)

    async def many() -> list[int]:
        return await asyncio.gather(*(one(i) for i in range(6)))

    assert asyncio.run(many()) == [4 + i for i in range(6)]


def test_abandoned_stream_is_aborted_and_frees_its_blocks(engine: AsyncEngine) -> None:
    async def abandon() -> None:
        params = SamplingParams(max_new_tokens=200, ignore_eos=True)
        stream = engine.generate("A long answer please", params, request_id="abandoned")
        async for out in stream:
            if len(out.token_ids) == 3:
                break
        await stream.aclose()
        for _ in range(200):
            if "abandoned" not in engine.engine.requests:
                break
            await asyncio.sleep(0.01)

    asyncio.run(abandon())
    assert "abandoned" not in engine.engine.requests
    assert engine.engine.blocks.num_used_blocks == 0


def test_bad_request_raises_before_any_output(engine: AsyncEngine) -> None:
    async def bad() -> None:
        async for _ in engine.generate("hello", adapter_id="no-such-adapter"):
            pass

    with pytest.raises(UnknownAdapterError, match="not known"):  # raised on the engine thread
        asyncio.run(bad())


def test_time_to_first_token_counts_from_the_callers_arrival(engine: AsyncEngine) -> None:
    """A server hands the engine the time a request reached it: TTFT on /metrics counts from
    there, not from when the loop thread took the request."""
    from prometheus_client.parser import text_string_to_metric_families

    from lora_guard.metrics import metrics_of

    plugin = metrics_of(engine.engine.hooks.pm)
    assert plugin is not None

    def ttft_sum() -> float:
        text = plugin.render().decode()
        return sum(
            s.value
            for f in text_string_to_metric_families(text)
            for s in f.samples
            if s.name == "vllm:time_to_first_token_seconds_sum"
        )

    async def one(arrival: float | None) -> None:
        params = SamplingParams(max_new_tokens=2, ignore_eos=True)
        async for _ in engine.generate("Waited at the door", params, arrival_time=arrival):
            pass

    before = ttft_sum()
    asyncio.run(one(None))
    now = ttft_sum()
    assert 0 < now - before < 1.0
    asyncio.run(one(time.monotonic() - 5.0))
    assert 5.0 <= ttft_sum() - now < 6.0
