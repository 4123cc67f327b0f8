"""Beyond --max-concurrent-requests the server answers 429 with Retry-After, never queues."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from lora_guard import LLM, SamplingParams
from lora_guard.engine.async_engine import AsyncEngine
from lora_guard.server.errors import APIError
from lora_guard.server.state import Limits, ServerState


def test_a_request_beyond_the_limit_is_overloaded(tiny_model: Path) -> None:
    llm = LLM(tiny_model, kv_cache_memory="4MiB", policies="lru")
    engine = AsyncEngine(llm.engine)
    engine.start()
    state = ServerState(
        engine, Limits(max_concurrent_requests=1, max_input_tokens=100, max_total_tokens=200)
    )
    params = SamplingParams(max_new_tokens=50, ignore_eos=True)

    async def scenario() -> APIError:
        first = state.generate([5, 6, 7], params, None, "acme")
        await first.__anext__()  # running
        try:
            second = state.generate([5, 6, 8], params, None, "acme")
            with pytest.raises(APIError) as caught:
                await second.__anext__()
            return caught.value
        finally:
            await first.aclose()  # the client goes away: aborted, the place freed

    try:
        error = asyncio.run(scenario())
        assert error.status == 429 and error.error_type == "overloaded"
        assert error.headers()["Retry-After"] == "1"
        assert state.in_flight == 0

        async def again() -> int:
            return len([o async for o in state.generate([5], params, None, "acme")][-1].token_ids)

        assert asyncio.run(again()) == 50
    finally:
        engine.shutdown()
    llm.engine.check_no_leaks()
