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
from lora_guard.demo.testing import ServerProcess as Server

PROMPT = "The capital of France is"
NEW = 8


@pytest.fixture(scope="module")
def reference(tiny: tuple[Path, Path]) -> LLM:
    model, adapters = tiny
    return LLM(
        model,
        adapter_dir=adapters,
        kv_cache_memory="16MiB",
        settings={"cold_loads_per_minute": 100},
    )


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
    prompt = reference.tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    )
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
    stream = client.text_generation(
        PROMPT, max_new_tokens=NEW, details=True, stream=True, adapter_id=adapter
    )
    assert [chunk.token.id for chunk in stream] == want


def test_adapters_answer_differently(reference: LLM) -> None:
    outputs = {tuple(expected(reference, PROMPT, a)) for a in (None, "a-00", "a-01", "a-02")}
    assert len(outputs) > 1


@pytest.mark.parametrize("adapter", ["a-01", "tgi"])
def test_openai_chat_and_completions(server: Server, reference: LLM, adapter: str) -> None:
    client = OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=60)
    engine_adapter = None if adapter == "tgi" else adapter
    messages = [{"role": "user", "content": "What is a LoRA adapter?"}]
    prompt = reference.tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    )
    want = reference.generate(prompt, SamplingParams(max_new_tokens=NEW), engine_adapter)[0]
    chat = client.chat.completions.create(
        model=adapter, messages=messages, max_tokens=NEW, temperature=0
    )
    assert chat.choices[0].message.content == want.text
    assert chat.usage is not None and chat.usage.completion_tokens == len(want.token_ids)
    stream = client.chat.completions.create(
        model=adapter, messages=messages, max_tokens=NEW, temperature=0, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == want.text

    plain = reference.generate(PROMPT, SamplingParams(max_new_tokens=NEW), engine_adapter)[0]
    completion = client.completions.create(
        model=adapter, prompt=PROMPT, max_tokens=NEW, temperature=0
    )
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
        text = reference.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False
        )
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
    """A chunk for every generated token, as vLLM streams (its text empty while a character is
    unfinished), so a client's TTFT and inter-token times are the engine's."""
    body = {
        "model": "a-00",
        "prompt": PROMPT,
        "max_tokens": NEW,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        lines = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    events = [json.loads(line) for line in lines[:-1]]
    counts = [e["usage"]["completion_tokens"] for e in events]
    assert counts[: NEW - 1] == list(range(1, NEW))  # the last token's text may ride on the end
    assert set(counts[NEW - 1 :]) == {NEW} and len(counts) in (NEW + 1, NEW + 2)
    assert events[-1]["choices"] == [] and events[-2]["choices"][0]["finish_reason"] == "length"
    refused = httpx.post(server.url + "/v1/completions", timeout=60, json={**body, "stream": False})
    assert refused.status_code == 422
    assert "stream_options" in refused.json()["error"]


def test_vllm_tokenize_and_detokenize_beside_tgis(server: Server, reference: LLM) -> None:
    """vLLM's bodies on /tokenize give the ids the engine computes on (a chat's count equals the
    chat answer's prompt tokens); TGI's body on the same path still gets TGI's answer."""
    url = server.url
    prompt = httpx.post(url + "/tokenize", json={"prompt": PROMPT}, timeout=60).json()
    assert prompt["tokens"] == reference.engine.encode(PROMPT)
    assert prompt["count"] == len(prompt["tokens"]) and prompt["max_model_len"] > 0
    messages = [{"role": "user", "content": "What is a LoRA adapter?"}]
    chat = httpx.post(
        url + "/tokenize",
        timeout=60,
        json={"model": "a-01", "messages": messages, "return_token_strs": True},
    ).json()
    client = OpenAI(base_url=url + "/v1", api_key="unused", timeout=60)
    answer = client.chat.completions.create(model="a-01", messages=messages, max_tokens=2)
    assert answer.usage is not None and chat["count"] == answer.usage.prompt_tokens
    assert len(chat["token_strs"]) == chat["count"]
    plain = httpx.post(
        url + "/tokenize", json={"prompt": PROMPT, "add_special_tokens": False}, timeout=60
    ).json()
    back = httpx.post(url + "/detokenize", json={"tokens": plain["tokens"]}, timeout=60)
    assert back.status_code == 200 and back.json() == {"prompt": PROMPT}
    tgi = httpx.post(url + "/tokenize", json={"inputs": PROMPT}, timeout=60).json()
    assert [t["id"] for t in tgi] == plain["tokens"]
    bad = httpx.post(url + "/detokenize", json={"tokens": [10**9]}, timeout=60)
    assert bad.status_code == 422 and "vocabulary" in bad.json()["error"]
    unknown = httpx.post(url + "/tokenize", json={"prompt": "x", "model": "nope"}, timeout=60)
    assert unknown.status_code == 404


def test_vllm_sampling_extras_on_the_openai_routes(server: Server, reference: LLM) -> None:
    client = OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=60)
    ask = {"model": "a-00", "prompt": PROMPT, "max_tokens": NEW, "temperature": 0}
    first = reference.generate(PROMPT, SamplingParams(max_new_tokens=NEW), "a-00")[0].token_ids[0]
    stopped = client.completions.create(**ask, extra_body={"stop_token_ids": [first]})
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.usage is not None and stopped.usage.completion_tokens == 1
    held = client.completions.create(
        **ask, extra_body={"stop_token_ids": [first], "min_tokens": 3, "ignore_eos": True}
    )
    assert held.usage is not None and held.usage.completion_tokens >= 3  # no end before 3
    sampled = {**ask, "temperature": 0.8, "seed": 7}
    extras = {"top_k": 5, "repetition_penalty": 1.2, "unknown_field": 1}
    twice = [
        client.completions.create(**sampled, extra_body=extras).choices[0].text for _ in range(2)
    ]
    assert twice[0] == twice[1]  # seeded: the same text
    for bad in ({"repetition_penalty": 0}, {"top_k": -2}, {"min_tokens": NEW + 1}):
        reply = httpx.post(server.url + "/v1/completions", json={**ask, **bad}, timeout=60)
        assert reply.status_code == 422, bad
        assert next(iter(bad)) in reply.json()["error"]
