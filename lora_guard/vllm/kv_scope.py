"""Adapter- and tenant-scoped prefix-cache keys in vLLM's OpenAI server.

vLLM keys its cached blocks by the adapter's name and path, so an adapter reloaded under the same
name with new weights hits the old KV, and every tenant shares every prefix. ``KVScope`` is an
ASGI middleware (``vllm serve ... --middleware lora_guard.vllm.KVScope``) that sets each
completion's ``cache_salt`` to lora-guard's KV namespace, asked of the same plugins as the
bundled engine (``lora_guard_cache_namespace``): the base model, the adapter and its content hash
(its files as they are now), the tenant with ``kv_namespace_scope = "tenant"``, and the client's
own ``cache_salt`` when it sent one. vLLM hashes the salt into the first block of the prompt,
so requests with different namespaces share no cached block.

The tenant is the bearer token's digest (vLLM's API keys name no tenant) together with
``X-Tenant-Id``, else the gateway's fairness id: a client cannot reach another key's prefixes by
naming its tenant. Settings are lora-guard's, from ``LORA_GUARD_*`` variables or the file
``LORA_GUARD_CONFIG`` names (``docs/vllm.md``).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Awaitable, Callable, Hashable, Mapping, MutableMapping
from pathlib import Path
from typing import Any

from lora_guard.engine.lora.checkpoint import CONFIG_FILE, WEIGHTS_FILE, content_hash
from lora_guard.naming import json_object
from lora_guard.plugins.manager import Hooks
from lora_guard.plugins.state import RequestView
from lora_guard.tenancy import header_tenant
from lora_guard.vllm.settings import configured_hooks

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

#: the routes whose bodies carry a prompt and a ``cache_salt``
SALTED_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
MAX_BODY_BYTES = 64 * 2**20  # a larger body passes untouched; vLLM answers it
TESTED_VLLM = ("0.31", "0.32")  # major.minor of the vLLM releases the integration test runs on


class AdapterDigests:
    """Each adapter folder's content hash, read again only when its files change."""

    def __init__(self) -> None:
        self._known: dict[Path, tuple[tuple[int, ...], str]] = {}

    def of(self, folder: Path) -> str | None:
        files = (folder / CONFIG_FILE, folder / WEIGHTS_FILE)
        try:
            stamp = tuple(n for f in files for n in (f.stat().st_mtime_ns, f.stat().st_size))
            known = self._known.get(folder)
            if known is not None and known[0] == stamp:
                return known[1]
            digest = content_hash(files[0].read_bytes(), files[1].read_bytes())
        except OSError:
            return None  # no PEFT safetensors folder: vLLM's own name-and-path key stays
        self._known[folder] = (stamp, digest)
        return digest


def tenant_of(headers: Mapping[str, str]) -> str:
    """The tenant a request's headers name: its bearer token's digest and its tenant header."""
    parts = []
    authorization = headers.get("authorization", "")
    if authorization.lower().startswith("bearer "):
        token = authorization[7:].strip().encode()
        parts.append("key:" + hashlib.sha256(token).hexdigest()[:16])
    named = header_tenant(headers)
    if named is not None:
        parts.append(named)
    return "/".join(parts) or "default"


def salt_of(namespace: Hashable) -> str:
    """A ``cache_salt`` vLLM accepts (hex, at most 128 characters) for a namespace."""
    return hashlib.sha256(repr(namespace).encode()).hexdigest()


class KVScope:
    """ASGI middleware: every completion's ``cache_salt`` is its lora-guard KV namespace."""

    def __init__(self, app: ASGIApp, hooks: Hooks | None = None) -> None:
        self.app = app
        self.hooks = hooks if hooks is not None else configured_hooks()[0]
        self.digests = AdapterDigests()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] != "http"
            or scope["method"] != "POST"
            or scope["path"] not in SALTED_PATHS
        ):
            await self.app(scope, receive, send)
            return
        body, more = await read_body(receive)
        if more:  # too large to rewrite: passed on as it came
            await self.app(scope, replay(body, receive, more=True), send)
            return
        salted = self.salted(scope, body)
        scope = {**scope, "headers": sized(scope["headers"], salted)}
        await self.app(scope, replay(salted, receive), send)

    def salted(self, scope: Scope, body: bytes) -> bytes:
        """``body`` with its ``cache_salt`` set; a body that is not a JSON object is vLLM's to
        refuse, and passes untouched."""
        payload = json_object(body)
        if payload is None:
            return body
        own_salt = payload.get("cache_salt")
        if own_salt is not None and not (isinstance(own_salt, str) and own_salt):
            return body  # vLLM's own check answers a malformed salt
        models = served_models(scope)
        if models is None:
            raise RuntimeError(
                "KVScope runs inside vLLM's OpenAI server (--middleware), whose registry of "
                f"served models (app.state.openai_serving_models) it reads; tested on vLLM "
                f"{', '.join(TESTED_VLLM)}"
            )
        base = models.base_model_paths[0].name
        model = payload.get("model")
        lora = models.lora_requests.get(model) if isinstance(model, str) else None
        adapter_id = model if lora is not None else None
        adapter_hash = self.digests.of(Path(lora.lora_path)) if lora is not None else None
        headers = header_map(scope)
        view = RequestView(
            request_id="",
            adapter_id=adapter_id,
            tenant_id=tenant_of(headers),
            num_prompt_tokens=0,
            num_output_tokens=0,
            arrival_time=0.0,
            waited_steps=0,
            cache_salt=own_salt,
        )
        namespace = self.hooks.cache_namespace(
            request=view, base_model_id=base, adapter_hash=adapter_hash
        )
        if namespace is None:  # no kv-namespace policy: the adapter's weights, as the engine
            namespace = ("base", base, "adapter", adapter_id, "weights", adapter_hash)
        payload["cache_salt"] = salt_of(namespace)
        return json.dumps(payload).encode()


def served_models(scope: Scope) -> Any:
    """vLLM's registry of served models and adapters (``app.state.openai_serving_models``), or
    None outside vLLM's OpenAI server."""
    return getattr(getattr(scope.get("app"), "state", None), "openai_serving_models", None)


def header_map(scope: Scope) -> dict[str, str]:
    """The request's headers by lower-case name."""
    return {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}


def sized(headers: list[tuple[bytes, bytes]], body: bytes) -> list[tuple[bytes, bytes]]:
    """``headers`` with a ``content-length`` that is ``body``'s."""
    kept = [(k, v) for k, v in headers if k.lower() != b"content-length"]
    return [*kept, (b"content-length", str(len(body)).encode())]


async def read_body(receive: Receive) -> tuple[bytes, bool]:
    """The request's body, and whether more of it is left unread (past ``MAX_BODY_BYTES``)."""
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return b"".join(chunks), False
        chunk = message.get("body", b"")
        chunks.append(chunk)
        size += len(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks), False
        if size > MAX_BODY_BYTES:
            return b"".join(chunks), True


def replay(body: bytes, receive: Receive, more: bool = False) -> Receive:
    """A ``receive`` that gives ``body`` first, then what the client sends next."""
    sent = False

    async def replayed() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": more}
        return await receive()

    return replayed
