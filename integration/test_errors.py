"""Bad requests get TGI's error bodies and codes; the cold-load budget answers 429."""

from __future__ import annotations

import httpx
import pytest

from lora_guard.demo.testing import ServerProcess as Server


@pytest.mark.parametrize(
    ("parameters", "message"),
    [
        ({"adapter_id": "nope"}, "adapter 'nope' is not known"),
        ({"adapter_id": "../a-00"}, "invalid adapter id"),
        ({"adapter_id": "a/b"}, "invalid adapter id"),
        ({"temperature": 0}, "`temperature` must be strictly positive"),
        ({"top_k": -1}, "`top_k` must be strictly positive"),
        ({"top_p": 1.5}, "`top_p` must be > 0.0 and <= 1.0"),
        ({"max_new_tokens": 0}, "`max_new_tokens` must be strictly positive"),
        ({"max_new_tokens": 100000}, "`inputs` tokens + `max_new_tokens` must be <="),
        ({"stop": ["a", "b", "c", "d", "e"]}, "`stop` must have at most 4 items"),
        ({"best_of": 2}, "`best_of` != 1 is not supported"),
    ],
)
def test_invalid_requests_get_422_with_tgi_messages(
    server: Server, parameters: dict[str, object], message: str
) -> None:
    for route in ("/generate", "/generate_stream"):
        r = httpx.post(server.url + route, json={"inputs": "hello", "parameters": parameters})
        assert r.status_code == 422, r.text
        assert r.json()["error_type"] == "validation"
        assert message in r.json()["error"]


def test_unknown_model_on_openai_routes_is_404(server: Server) -> None:
    body = {"model": "nope", "messages": [{"role": "user", "content": "hi"}]}
    r = httpx.post(server.url + "/v1/chat/completions", json=body)
    assert r.status_code == 404 and "not known" in r.json()["error"]


def test_malformed_body_is_422(server: Server) -> None:
    r = httpx.post(server.url + "/generate", json={"parameters": {}})
    assert r.status_code == 422 and r.json()["error_type"] == "validation"
    assert "inputs" in r.json()["error"]


def test_the_base_model_is_named_never_a_path(server: Server) -> None:
    info = httpx.get(server.url + "/info").json()
    models = httpx.get(server.url + "/v1/models").json()["data"]
    names = [info["model_id"], *(m["id"] for m in models), *(m.get("parent", "") for m in models)]
    assert info["model_id"] and all("/" not in n and "\\" not in n for n in names), names
    assert models[0]["id"] == info["model_id"]


@pytest.mark.parametrize(
    ("route", "body"),
    [
        ("/generate", '{"inputs": "hello", "parameters": {"temperature": NaN}}'),
        ("/generate", '{"inputs": "hello", "parameters": {"top_p": Infinity}}'),
        (
            "/v1/chat/completions",
            '{"model": "tgi", "messages": [{"role": "user", "content": "hi"}], "top_p": -Infinity}',
        ),
        ("/v1/completions", '{"model": "tgi", "prompt": "hi", "temperature": NaN}'),
    ],
)
def test_nan_and_infinity_are_not_numbers_a_request_may_carry(
    server: Server, route: str, body: str
) -> None:
    r = httpx.post(server.url + route, content=body, headers={"content-type": "application/json"})
    assert r.status_code == 422, r.text
    assert r.json()["error_type"] == "validation"
    assert "finite number" in r.json()["error"]
