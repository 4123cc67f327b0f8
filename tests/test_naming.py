"""Which adapter a request names: the server's and the Ray ingress's one rule."""

from __future__ import annotations

import pytest

from lora_guard.naming import adapter_of, named_in

BASE = "HuggingFaceTB/SmolLM2-135M"


@pytest.mark.parametrize("name", [None, "", "tgi", BASE, 7])
def test_no_name_tgi_and_the_base_models_id_mean_the_base_model(name: object) -> None:
    assert adapter_of(name, BASE) is None


def test_any_other_name_is_an_adapter_as_sent() -> None:
    assert adapter_of("tenant-a/sql", BASE) == "tenant-a/sql"
    assert adapter_of("TGI", BASE) == "TGI"  # names are case-sensitive, as adapter ids are


def test_tgi_names_it_in_parameters_openai_in_model() -> None:
    tgi = {"inputs": "hi", "parameters": {"adapter_id": "sql"}, "model": "ignored"}
    assert [named_in(path, tgi) for path in ("/generate", "/generate_stream", "/")] == ["sql"] * 3
    openai = {"model": "sql", "parameters": {"adapter_id": "ignored"}}
    assert named_in("/v1/completions", openai) == "sql"
    assert named_in("/v1/chat/completions", openai) == "sql"
    assert named_in("/generate", {"inputs": "hi"}) is None
    assert named_in("/generate", {"parameters": "not an object"}) is None
    assert named_in("/tokenize", openai) is None  # not a generation route
