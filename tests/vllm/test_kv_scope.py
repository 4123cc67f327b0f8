"""The pieces of lora_guard.vllm's KV scope that need no vLLM: who the tenant is, and the
adapter's version as the bundled engine names it (integration/test_vllm_plugin.py runs it in
vLLM)."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from transformers import AutoConfig

from lora_guard.demo.testing import AdapterFactory
from lora_guard.engine.lora.checkpoint import read_adapter
from lora_guard.engine.spec import ModelSpec
from lora_guard.plugins.manager import Hooks, make_plugin_manager
from lora_guard.vllm.kv_scope import AdapterDigests, KVScope, salt_of, tenant_of


def test_the_tenant_is_the_key_and_the_tenant_header_together() -> None:
    assert tenant_of({}) == "default"
    assert tenant_of({"x-tenant-id": "acme"}) == "acme"
    assert tenant_of({"x-gateway-inference-fairness-id": "acme"}) == "acme"
    one, other = (
        tenant_of({"authorization": "Bearer k1"}),
        tenant_of({"authorization": "Bearer k2"}),
    )
    assert one != other and "k1" not in one  # a key is named by its digest, never itself
    named = tenant_of({"authorization": "Bearer k1", "x-tenant-id": "acme"})
    assert named.startswith(one) and named.endswith("/acme")  # a header cannot leave its key


def test_an_adapters_digest_is_the_engines_content_hash_and_follows_its_files(
    tiny_model: Path, tiny_adapters: AdapterFactory, tmp_path: Path
) -> None:
    first, second = tiny_adapters(2, "scope").values()
    folder = tmp_path / "a"
    shutil.copytree(first, folder)
    spec = ModelSpec.from_config(AutoConfig.from_pretrained(tiny_model))
    digests = AdapterDigests()
    before = digests.of(folder)
    assert before == read_adapter("a", folder, spec, 64).content_hash
    shutil.copyfile(second / "adapter_model.safetensors", folder / "adapter_model.safetensors")
    assert digests.of(folder) == read_adapter("a", folder, spec, 64).content_hash != before
    assert digests.of(tmp_path / "missing") is None


def test_a_salt_is_one_vllm_accepts() -> None:
    salt = salt_of(("base", "tiny", "adapter", "a"))
    assert len(salt) <= 128 and salt.isalnum()
    assert salt != salt_of(("base", "tiny", "adapter", "b"))


def _echo_app(folder: Path) -> Starlette:
    """An app that answers with the body it received, holding vLLM's registry of served models
    (``state.openai_serving_models``) as vLLM's OpenAI server does."""

    async def echo(request: Request) -> Response:
        return Response(await request.body(), media_type="application/json")

    app = Starlette(routes=[Route("/v1/completions", echo, methods=["POST", "GET"])])
    hooks = Hooks(make_plugin_manager("kv-namespace"))
    hooks.configure({"kv_namespace_scope": "tenant"})
    app.add_middleware(KVScope, hooks=hooks)  # as vLLM adds a --middleware class
    app.state.openai_serving_models = SimpleNamespace(
        base_model_paths=[SimpleNamespace(name="tiny")],
        lora_requests={"a": SimpleNamespace(lora_path=str(folder))},
    )
    return app


async def _post(app: Starlette, body: bytes, tenant: str = "t1") -> bytes:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        reply = await client.post("/v1/completions", content=body, headers={"x-tenant-id": tenant})
    return reply.content


def test_the_middleware_salts_a_completion_by_tenant_and_adapter_version(
    tiny_adapters: AdapterFactory,
) -> None:
    (folder,) = tiny_adapters(1, "echo").values()
    app = _echo_app(folder)

    def salt(body: dict[str, object], tenant: str = "t1") -> object:
        return json.loads(asyncio.run(_post(app, json.dumps(body).encode(), tenant)))["cache_salt"]

    adapter = {"model": "a", "prompt": "hi"}
    assert salt(adapter) == salt(adapter) != salt(adapter, tenant="t2")
    assert salt(adapter) != salt({"model": "tiny", "prompt": "hi"})  # the base model apart
    assert salt(adapter) != salt({**adapter, "cache_salt": "mine"})  # the client's salt kept in
    assert asyncio.run(_post(app, b"not json")) == b"not json"  # vLLM answers it, untouched
    bad = json.dumps({**adapter, "cache_salt": ""}).encode()
    assert asyncio.run(_post(app, bad)) == bad


def test_outside_vllms_server_the_middleware_says_so() -> None:
    app = Starlette()
    app.state.other = None
    hooks = Hooks(make_plugin_manager("kv-namespace"))
    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": [], "app": app}
    with pytest.raises(RuntimeError, match="inside vLLM's OpenAI server"):
        KVScope(app, hooks).salted(scope, b'{"model": "a"}')
