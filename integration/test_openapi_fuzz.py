"""Fuzz the generation routes with bodies drawn from the server's own OpenAPI document
(``GET /openapi.json``): bodies that fit the schema, bodies with one field of the wrong type or
a required field missing, and arbitrary JSON. No answer may be a 5xx, every error must be TGI's
error body, every stream must end without an error event, and the server must stay healthy.

Seeded (``derandomize``), so every run sends the same bodies.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from lora_guard.demo.testing import ServerProcess, start_server

BODIES_PER_ROUTE = 300
ROUTES = ("/generate", "/generate_stream", "/", "/v1/chat/completions", "/v1/completions")
Schema = dict[str, Any]

JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=6,
)
STRINGS = st.one_of(
    st.text(max_size=20),
    st.sampled_from(
        [
            "",
            " ",
            "<|im_end|>",
            "<|im_start|>user",
            "\x00",
            "\ud800",
            "é" * 40,
            "hello " * 400,
            "a-00",
            "../a-00",
            "/etc/passwd",
        ]
    ),
)
INTEGERS = st.one_of(
    st.integers(-5, 40), st.sampled_from([2**31, 2**63, 2**64, -(2**63) - 1, 10**30])
)
NUMBERS = st.one_of(
    st.floats(), st.sampled_from([0.0, -0.0, 1e-300, 5e-324, 1.0, 2.0, 1e308, -1.0])
)
# Fields whose plain schema (a string, an integer) would almost never reach generation.
HINTS: dict[str, st.SearchStrategy[Any]] = {
    "adapter_id": st.sampled_from([None, "a-00", "a-01", "tgi", "", "nope", "../a-00"]),
    "model": st.sampled_from([None, "a-00", "a-02", "tgi", "nope", "a/b", ".."]),
    "role": st.sampled_from(["user", "system", "assistant", "", "tool"]),
    "max_new_tokens": st.one_of(st.none(), st.integers(-1, 6), INTEGERS),
    "max_tokens": st.one_of(st.none(), st.integers(-1, 6), INTEGERS),
    "max_completion_tokens": st.one_of(st.none(), st.integers(-1, 6)),
    # OpenAI's: a prompt list of one, one choice, and stream_options only with a stream; the
    # schema alone would make these the reason for most answers
    "prompt": st.one_of(STRINGS, STRINGS, STRINGS, st.lists(STRINGS, max_size=2)),
    "n": st.sampled_from([None, 1, 1, 1, 2, 0, -1]),
    "stream_options": st.one_of(
        st.none(),
        st.none(),
        st.none(),
        st.fixed_dictionaries(
            {}, optional={"include_usage": st.booleans(), "continuous_usage_stats": st.booleans()}
        ),
    ),
}


def from_schema(doc: Schema, schema: Schema, name: str = "") -> st.SearchStrategy[Any]:
    """Values that fit ``schema`` (pydantic's JSON schema: $ref, anyOf, the JSON types)."""
    if name in HINTS:
        return HINTS[name]
    if "$ref" in schema:
        target: Any = doc
        for part in schema["$ref"].removeprefix("#/").split("/"):
            target = target[part]
        return from_schema(doc, target)
    if "anyOf" in schema:
        return st.one_of([from_schema(doc, option, name) for option in schema["anyOf"]])
    kind = schema.get("type")
    if kind == "object" and "properties" in schema:
        required = set(schema.get("required", ()))
        fields = {n: from_schema(doc, s, n) for n, s in schema["properties"].items()}
        return st.fixed_dictionaries(
            {n: f for n, f in fields.items() if n in required},
            optional={n: f for n, f in fields.items() if n not in required},
        )
    if kind == "object":
        return st.dictionaries(
            st.sampled_from(["type", "text"]) | st.text(max_size=5),
            STRINGS | JSON_VALUES,
            max_size=3,
        )
    if kind == "array":
        return st.lists(from_schema(doc, schema.get("items", {})), max_size=3)
    simple = {
        "string": STRINGS,
        "integer": INTEGERS,
        "number": NUMBERS,
        "boolean": st.booleans(),
        "null": st.none(),
    }
    return simple.get(kind, JSON_VALUES) if isinstance(kind, str) else JSON_VALUES


def bodies(doc: Schema, route: str) -> st.SearchStrategy[Any]:
    """Mostly schema-fitting bodies; some with one field broken or a required one missing; some
    arbitrary JSON."""
    schema = doc["paths"][route]["post"]["requestBody"]["content"]["application/json"]["schema"]
    fitting = from_schema(doc, schema)

    @st.composite
    def broken(draw: st.DrawFn) -> Any:
        body = draw(fitting)
        if body:
            field = draw(st.sampled_from(sorted(body)))
            if draw(st.booleans()):
                body[field] = draw(JSON_VALUES)
            else:
                del body[field]
        return body

    return st.integers(0, 9).flatmap(
        lambda i: broken() if i in (3, 4) else JSON_VALUES if i == 5 else fitting
    )


def problems_with(r: httpx.Response) -> list[str]:
    """What is wrong with one answer (nothing for a 2xx or a 4xx with TGI's error body)."""
    if r.status_code >= 500:
        return [f"{r.status_code}: {r.text[:300]}"]
    if r.status_code >= 400:
        try:
            body = r.json()
        except ValueError:
            return [f"{r.status_code} without a JSON body: {r.text[:200]}"]
        if not (isinstance(body, dict) and body.get("error") and body.get("error_type")):
            return [f"{r.status_code} without TGI's error body: {r.text[:200]}"]
        return []
    if r.headers.get("content-type", "").startswith("text/event-stream"):
        events = [line[5:].strip() for line in r.text.splitlines() if line.startswith("data:")]
        errors = [e for e in events if e != "[DONE]" and "error" in json.loads(e)]
        return [f"stream ended in an error event: {errors[0][:200]}"] if errors else []
    return []


@pytest.fixture(scope="module")
def target(
    tiny: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[ServerProcess, Schema]]:
    model, adapters = tiny
    log = tmp_path_factory.mktemp("openapi-fuzz") / "server.log"
    # Short generations (20 tokens at most, prompt included) keep a few hundred bodies quick.
    server = start_server(
        model, adapters, "--max-total-tokens", "20", "--cold-loads-per-minute", "1000", log=log
    )
    doc = httpx.get(server.url + "/openapi.json", timeout=10).json()
    yield server, doc
    assert server.stop() == 0


@pytest.mark.parametrize("route", ROUTES)
def test_no_body_breaks_a_generation_route(
    target: tuple[ServerProcess, Schema], route: str
) -> None:
    server, doc = target
    statuses: Counter[int] = Counter()
    problems: list[str] = []

    with httpx.Client(base_url=server.url, timeout=60) as http:

        @settings(
            max_examples=BODIES_PER_ROUTE,
            derandomize=True,
            database=None,
            deadline=None,
            phases=[Phase.explicit, Phase.generate],
            suppress_health_check=list(HealthCheck),
        )
        @given(body=bodies(doc, route))
        def send(body: Any) -> None:
            content = json.dumps(body, allow_nan=True)
            r = http.post(route, content=content, headers={"content-type": "application/json"})
            statuses[r.status_code] += 1
            problems.extend(f"{p}\n    body: {content[:300]}" for p in problems_with(r))

        send()

    print(f"\n{route}: {sum(statuses.values())} bodies, answers {dict(sorted(statuses.items()))}")
    assert not problems, f"{len(problems)} bad answers:\n" + "\n".join(problems[:10])
    assert sum(statuses.values()) == BODIES_PER_ROUTE
    assert statuses[200] >= BODIES_PER_ROUTE // 10, f"too few bodies reached the engine: {statuses}"
    assert server.process.poll() is None
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
