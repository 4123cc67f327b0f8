"""The real clients against the real server give the same tokens as the engine in-process."""

from __future__ import annotations

from pathlib import Path

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
