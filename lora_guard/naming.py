"""Which adapter a request names: one rule for the server and the Ray ingress.

A generation request names its adapter in its body: TGI's routes in ``parameters.adapter_id``,
OpenAI's in ``model``. No name, an empty one, ``"tgi"`` (what TGI's clients send when they name
no model) and the base model's own id all mean the base model.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

TGI_GENERATE = frozenset({"/generate", "/generate_stream", "/"})
OPENAI_GENERATE = frozenset({"/v1/completions", "/v1/chat/completions"})
BASE_NAMES = frozenset({"", "tgi"})


def adapter_of(name: object, base_model: str) -> str | None:
    """The adapter id ``name`` stands for, None for the base model (or a name that is not a
    string, which the route's validation refuses). Whether the adapter exists is the engine's
    to say."""
    if not isinstance(name, str) or name in BASE_NAMES or name == base_model:
        return None
    return name


def named_in(path: str, body: Mapping[str, object]) -> object:
    """The name a generation request's parsed JSON body gives its adapter, as sent (None where
    the route takes no adapter or the body names none)."""
    if path in TGI_GENERATE:
        parameters = body.get("parameters")
        return parameters.get("adapter_id") if isinstance(parameters, Mapping) else None
    if path in OPENAI_GENERATE:
        return body.get("model")
    return None


def json_object(body: bytes) -> dict[str, Any] | None:
    """The JSON object a request's body holds; None for a body that is not one (the server's to
    refuse)."""
    try:
        parsed = json.loads(body)
    except ValueError:
        return None
    return parsed if isinstance(parsed, dict) else None
