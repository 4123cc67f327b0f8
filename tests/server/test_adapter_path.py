"""A request's adapter id goes from the route to the KV key through one pipeline: it enters each
file once, whichever route it came by; the engine's door alone says whether it is valid and
exists; past the door the id travels inside the request's sequence, which the scheduler and the
residency manager are handed instead of the id, and the scheduler binds its KV scope once.

Besides the door, the registry is asked one other question, in one place: where an adapter's
files are, when the residency manager reads its weights (``ResidencyManager._registration``)."""

from __future__ import annotations

import dis
import hashlib
import sys
import threading
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import CodeType, FrameType
from typing import Any

import pytest
from fastapi.testclient import TestClient

import lora_guard
from lora_guard import LLM
from lora_guard.demo.adapters import make_adapters
from lora_guard.engine.async_engine import AsyncEngine
from lora_guard.server.app import create_app
from lora_guard.server.auth import ApiKey, KeyRing
from lora_guard.server.state import Limits, ServerState

PACKAGE = Path(lora_guard.__file__).parent
ADAPTER = "path-00"
KEY = {"Authorization": "Bearer app-secret"}
TGI = {"adapter_id": ADAPTER, "max_new_tokens": 2}
# one row a line, as a table reads (fmt: skip)
ROUTES = [
    ("/generate", {"inputs": "hello " * 40, "parameters": TGI}),  # fills KV blocks
    ("/generate_stream", {"inputs": "hi", "parameters": TGI}),
    ("/", {"inputs": "hey", "stream": True, "parameters": TGI}),
    ("/v1/completions", {"model": ADAPTER, "prompt": "hello", "max_tokens": 2}),
    ("/v1/chat/completions", {"model": ADAPTER, "max_tokens": 2, "stream": True,
                              "messages": [{"role": "user", "content": "hi"}]}),
]  # fmt: skip


@dataclass
class Trace:
    """Each call of a lora_guard function that gets ``value`` as an argument: which file and
    function, which thread, and the nearest lora_guard line it was called from."""

    value: str
    calls: list[tuple[str, str, str, str]] = field(default_factory=list)
    _starts: dict[CodeType, int] = field(default_factory=dict)

    def profile(self, frame: FrameType, event: str, _arg: Any) -> None:
        code = frame.f_code
        if event != "call" or not code.co_filename.startswith(str(PACKAGE)):
            return
        if frame.f_lasti > self._start(code):
            return  # a generator or coroutine resumed, not a new call
        if not any(
            v is self.value or (type(v) is str and v == self.value) for v in frame.f_locals.values()
        ):
            return
        caller = frame.f_back
        while caller is not None and not caller.f_code.co_filename.startswith(str(PACKAGE)):
            caller = caller.f_back
        where = "" if caller is None else f"{_name(caller.f_code)}:{caller.f_lineno}"
        name = getattr(code, "co_qualname", code.co_name)
        self.calls.append((_name(code), name, where, threading.current_thread().name))

    def entries(self) -> dict[str, set[tuple[str, str]]]:
        """For each file, the places the value was handed into it from another owner's file."""
        found: dict[str, set[tuple[str, str]]] = defaultdict(set)
        for file, name, where, _thread in self.calls:
            if _owner(where.rpartition(":")[0]) != _owner(file):
                found[file].add((where, name))
        return found

    def _start(self, code: CodeType) -> int:
        if code not in self._starts:  # where a call begins: later offsets are resumptions
            ops = dis.get_instructions(code)
            self._starts[code] = next((i.offset for i in ops if i.opname == "RESUME"), -1)
        return self._starts[code]


def _owner(file: str) -> str:
    """Files that make one part: the residency's base and its two kinds."""
    residency = ("tiers.py", "residency.py", "merged.py")
    return (
        "residency"
        if file.startswith("lora_guard/engine/lora/") and file.endswith(residency)
        else file
    )


def _name(code: CodeType) -> str:
    return Path(code.co_filename).relative_to(PACKAGE.parent).as_posix()


@pytest.fixture(scope="module")
def adapters(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("path-adapters")
    return {f.name: f for f in make_adapters(tiny_model, out, n=1, ranks=(4,), prefix="path")}


@pytest.fixture
def state(tiny_model: Path, adapters: dict[str, Path]) -> Iterator[ServerState]:
    llm = LLM(tiny_model, adapters=dict(adapters), kv_cache_memory="4MiB", policies="lru")
    yield ServerState(AsyncEngine(llm.engine), Limits(4, 100, 200))
    llm.engine.check_no_leaks()


def test_the_adapter_id_enters_each_server_file_once(state: ServerState) -> None:
    state.keys = KeyRing(
        [ApiKey("app", hashlib.sha256(b"app-secret").hexdigest(), "acme", ("path-*",), admin=False)]
    )
    trace = Trace(ADAPTER)
    threading.setprofile(trace.profile)  # the app's and the engine's threads start below
    sys.setprofile(trace.profile)
    try:
        with TestClient(create_app(state)) as client:
            for route, body in ROUTES:
                r = client.post(route, json=body, headers=KEY)
                assert r.status_code == 200, (route, r.text)
    finally:
        sys.setprofile(None)
        threading.setprofile(None)

    entries = trace.entries()
    server = [file for file in entries if file.startswith("lora_guard/server/")]
    assert {"lora_guard/server/auth.py", "lora_guard/server/state.py"} <= set(server)
    door = [
        "lora_guard/engine/async_engine.py",  # the bridge from the HTTP threads
        "lora_guard/engine/llm_engine.py",  # add_request
        "lora_guard/engine/request_check.py",  # valid and registered, asked once
        "lora_guard/engine/lora/registry.py",
    ]
    for file in [*server, *door[:-1]]:
        assert len(entries[file]) == 1, (file, entries[file])
    asked = {(where.rpartition(":")[0], name) for where, name in entries[door[-1]]}
    assert asked == {
        ("lora_guard/engine/request_check.py", "AdapterRegistry.require"),  # the door
        ("lora_guard/engine/lora/tiers.py", "AdapterRegistry.get"),  # the weights' files
    }, entries[door[-1]]
    assert len(entries[door[-1]]) == 2, entries[door[-1]]
    # Past the door the scheduler, the residency manager and the block manager get the sequence.
    for file in ("scheduler.py", "lora/residency.py", "lora/tiers.py", "kv_cache.py", "runner.py"):
        assert f"lora_guard/engine/{file}" not in entries, entries[f"lora_guard/engine/{file}"]

    # On the threads that serve HTTP the id meets no engine code but the async bridge (and the
    # one rule for which names mean the base model, lora_guard/naming.py, which the Ray ingress
    # shares): whether it is valid and exists is asked on the engine's thread only.
    http = {thread for file, _, _, thread in trace.calls if file.startswith("lora_guard/server/")}
    met = {
        (file, name)
        for file, name, _, thread in trace.calls
        if thread in http
        and not file.startswith("lora_guard/server/")
        and file not in ("lora_guard/engine/async_engine.py", "lora_guard/naming.py")
    }
    assert not met, met
    # ... and it arrives in the KV key: the cached blocks of its prompts are scoped to it.
    scopes = {block.scope for block in state.llm.blocks.blocks if block.key is not None}
    assert any(s is not None and s.adapter_id == ADAPTER for s in scopes), scopes


def test_an_unknown_adapter_is_the_engines_answer_in_each_routes_dialect(
    state: ServerState,
) -> None:
    chat = {"model": "nope", "messages": [{"role": "user", "content": "hi"}]}
    cases = [
        ("/generate", {"inputs": "hi", "parameters": {"adapter_id": "nope"}}, 422, "validation"),
        (
            "/generate_stream",
            {"inputs": "hi", "parameters": {"adapter_id": "nope"}},
            422,
            "validation",
        ),
        ("/v1/completions", {"model": "nope", "prompt": "hi"}, 404, "not_found"),
        ("/v1/chat/completions", {**chat, "stream": True}, 404, "not_found"),
    ]
    with TestClient(create_app(state)) as client:
        for route, body, status, error_type in cases:
            r = client.post(route, json=body)
            assert r.status_code == status, (route, r.text)
            assert r.json() == {"error": "adapter 'nope' is not known", "error_type": error_type}
    assert state.in_flight == 0
