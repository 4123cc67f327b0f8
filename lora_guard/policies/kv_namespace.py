"""Adapter-scoped KV keys: the prefix-cache namespace names the weights the KV was computed under.

The namespace is a tuple of tagged parts, so no value of one part can be mistaken for another
(an adapter id equal to a cache salt, say): (base model id, adapter id, adapter content hash), plus
the tenant with ``kv_namespace_scope = "tenant"`` and a per-request cache salt when one is given.
``kv_namespace_mode = "observe"`` keys blocks by the base model only and lets hits across adapters
through, counting each as a conflict: it exists to show the hazard, never to serve.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

from lora_guard.plugins import hookimpl
from lora_guard.plugins.options import OptionRegistry
from lora_guard.plugins.state import RequestView

TAG = "lora-guard/kv-namespace/v1"
SCOPES = ("adapter", "tenant")
MODES = ("enforce", "observe")


class KVNamespacePolicy:
    def __init__(self) -> None:
        self.scope = "adapter"
        self.mode = "enforce"

    @hookimpl
    def lora_guard_add_options(self, options: OptionRegistry) -> None:
        options.add(
            "kv_namespace_scope",
            str,
            "adapter",
            "what prefix-cache hits are confined to: adapter, or tenant (and adapter)",
        )
        options.add(
            "kv_namespace_mode",
            str,
            "enforce",
            "enforce, or observe: share KV across adapters and count the conflicts",
        )

    @hookimpl
    def lora_guard_configure(self, config: dict[str, Any]) -> None:
        scope = config.get("kv_namespace_scope") or "adapter"
        mode = config.get("kv_namespace_mode") or "enforce"
        if scope not in SCOPES:
            raise ValueError(
                f"kv_namespace_scope must be one of {', '.join(SCOPES)}, not {scope!r}"
            )
        if mode not in MODES:
            raise ValueError(f"kv_namespace_mode must be one of {', '.join(MODES)}, not {mode!r}")
        self.scope, self.mode = scope, mode

    @hookimpl
    def lora_guard_cache_namespace(
        self, request: RequestView, base_model_id: str, adapter_hash: str | None
    ) -> Hashable:
        if self.mode == "observe":
            return (TAG, ("base", base_model_id))
        parts: list[tuple[str, str | None]] = [
            ("base", base_model_id),
            ("adapter", request.adapter_id),
            ("weights", adapter_hash),
        ]
        if self.scope == "tenant":
            parts.append(("tenant", request.tenant_id))
        if request.cache_salt is not None:
            parts.append(("salt", request.cache_salt))
        return (TAG, *parts)

    @hookimpl
    def lora_guard_cache_reuse(self) -> bool:
        return self.mode == "observe"
