"""The real clients against the real server give the same tokens as the engine in-process."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from huggingface_hub import InferenceClient
from openai import OpenAI
from text_generation import Client

from lora_guard import LLM, SamplingParams
from lora_guard.testing import ServerProcess as Server

PROMPT = "The capital of France is"
NEW = 8


@pytest.fixture(scope="module")
def reference(tiny: tuple[Path, Path]) -> LLM:
    model, adapters = tiny
    return LLM(model, adapter_dir=adapters, kv_cache_memory="16MiB",
               settings={"cold_loads_per_minute": 100})  # fmt: skip


def expected(llm: LLM, prompt: str | list[int], adapter: str | None) -> list[int]:
    params = SamplingParams(max_new_tokens=NEW)
    return llm.generate(prompt, params, adapter)[0].token_ids


def test_text_generation_client_generate_and_stream(server: Server, reference: LLM) -> None:
    client = Client(server.url, timeout=60)
    want = expected(reference, PROMPT, None)
    response = client.generate(PROMPT, max_new_tokens=NEW)
    assert [t.id for t in response.details.tokens] == want
    streamed = [r.token.id for r in client.generate_stream(PROMPT, max_new_tokens=NEW)]
    assert streamed == want


def test_text_generation_client_chat(server: Server, reference: LLM) -> None:
    client = Client(server.url, timeout=60)
    messages = [{"role": "user", "content": "hello"}]
    chat = client.chat(messages=messages, max_tokens=NEW, temperature=0)  # model "tgi": the base
    prompt = reference.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                     tokenize=False)  # fmt: skip
    want = reference.generate(prompt, SamplingParams(max_new_tokens=NEW))[0]
    assert chat.choices[0].message.content == want.text


@pytest.mark.parametrize("adapter", ["a-00", "a-02", None])
def test_huggingface_hub_client_with_adapters(
    server: Server, reference: LLM, adapter: str | None
) -> None:
    client = InferenceClient(base_url=server.url, timeout=60)
    want = expected(reference, PROMPT, adapter)
    out = client.text_generation(PROMPT, max_new_tokens=NEW, details=True, adapter_id=adapter)
    assert [t.id for t in out.details.tokens] == want
    stream = client.text_generation(PROMPT, max_new_tokens=NEW, details=True, stream=True,
                                    adapter_id=adapter)  # fmt: skip
    assert [chunk.token.id for chunk in stream] == want


def test_adapters_answer_differently(reference: LLM) -> None:
    outputs = {tuple(expected(reference, PROMPT, a)) for a in (None, "a-00", "a-01", "a-02")}
    assert len(outputs) > 1


@pytest.mark.parametrize("adapter", ["a-01", "tgi"])
def test_openai_chat_and_completions(server: Server, reference: LLM, adapter: str) -> None:
    client = OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=60)
    engine_adapter = None if adapter == "tgi" else adapter
    messages = [{"role": "user", "content": "What is a LoRA adapter?"}]
    prompt = reference.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                     tokenize=False)  # fmt: skip
    want = reference.generate(prompt, SamplingParams(max_new_tokens=NEW), engine_adapter)[0]
    chat = client.chat.completions.create(model=adapter, messages=messages, max_tokens=NEW,
                                          temperature=0)  # fmt: skip
    assert chat.choices[0].message.content == want.text
    assert chat.usage is not None and chat.usage.completion_tokens == len(want.token_ids)
    stream = client.chat.completions.create(model=adapter, messages=messages, max_tokens=NEW,
                                            temperature=0, stream=True)  # fmt: skip
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == want.text

    plain = reference.generate(PROMPT, SamplingParams(max_new_tokens=NEW), engine_adapter)[0]
    completion = client.completions.create(model=adapter, prompt=PROMPT, max_tokens=NEW,
                                           temperature=0)  # fmt: skip
    assert completion.choices[0].text == plain.text


def test_models_lists_the_base_and_every_adapter(server: Server) -> None:
    client = OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=60)
    ids = [m.id for m in client.models.list()]
    assert ids[1:] == ["a-00", "a-01", "a-02"]


@pytest.mark.parametrize("route", ["chat", "completions"])
def test_openai_stream_usage_equals_the_plain_answers(
    server: Server, reference: LLM, route: str
) -> None:
    """``stream_options.include_usage``: every chunk says ``usage: null`` and a last one, with no
    choices, carries the counts the plain answer gives: prompt tokens after the chat template,
    tokens generated."""
    client = OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=60)
    messages = [{"role": "user", "content": "What is a LoRA adapter?"}]
    ask: dict[str, Any] = {"model": "a-01", "max_tokens": NEW, "temperature": 0}
    if route == "chat":
        create: Callable[..., Any] = client.chat.completions.create
        ask["messages"] = messages
        text = reference.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                       tokenize=False)  # fmt: skip
    else:
        create, ask["prompt"], text = client.completions.create, PROMPT, PROMPT
    plain = create(**ask)
    chunks = list(create(**ask, stream=True, stream_options={"include_usage": True}))
    *body, last = chunks
    assert last.choices == [] and last.usage is not None
    assert all(c.usage is None and len(c.choices) == 1 for c in body)
    want = reference.generate(text, SamplingParams(max_new_tokens=NEW), "a-01")[0]
    assert last.usage.completion_tokens == len(want.token_ids) == NEW
    assert last.usage.prompt_tokens == len(reference.tokenizer.encode(text))
    assert last.usage.model_dump() == plain.usage.model_dump()
    silent = list(create(**ask, stream=True))
    assert all(c.usage is None for c in silent)  # not asked for: not sent


def test_continuous_usage_counts_every_chunk_and_options_need_a_stream(server: Server) -> None:
    body = {"model": "a-00", "prompt": PROMPT, "max_tokens": NEW, "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}  # fmt: skip
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        lines = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    events = [json.loads(line) for line in lines[:-1]]
    counts = [e["usage"]["completion_tokens"] for e in events]
    assert counts == sorted(counts) and counts[-1] == NEW
    assert events[-1]["choices"] == [] and events[-2]["choices"][0]["finish_reason"] == "length"
    refused = httpx.post(server.url + "/v1/completions", timeout=60,
                         json={**body, "stream": False})  # fmt: skip
    assert refused.status_code == 422
    assert "stream_options" in refused.json()["error"]
