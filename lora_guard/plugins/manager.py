"""Finds, registers and calls plugins.

Order of registration: built-in plugins (the policies chosen with ``--policies``, then the
always-on ones such as metrics), then entry points of the group ``lora_guard`` (unless
``LORA_GUARD_DISABLE_PLUGIN_AUTOLOAD`` is set), then ``--plugin module[:object]``. A name given to
``--disable-plugin`` is blocked before anything registers, so it never loads. A built-in given as
``module:Class`` is instantiated once per plugin manager, so each engine has its own state.
"""

from __future__ import annotations

import importlib
import logging
import os
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Any

import pluggy

from lora_guard.plugins import hookspecs
from lora_guard.plugins.decisions import AdapterDecision, BusyRetry, Reject
from lora_guard.plugins.eviction import Candidate
from lora_guard.plugins.options import OptionRegistry
from lora_guard.plugins.state import EngineState, RequestView

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "lora_guard"
DISABLE_AUTOLOAD_ENV = "LORA_GUARD_DISABLE_PLUGIN_AUTOLOAD"
GUARD_POLICIES = ("hot-set", "cold-budget", "kv-namespace")
RIVAL_POLICIES = ("lru", "fifo", "drain", "time-slice", "s3-fifo", "w-tinylfu")
BASELINE_POLICIES = (*RIVAL_POLICIES, "on-demand", "static")
DEFAULT_POLICIES = GUARD_POLICIES
POLICY_PLUGINS: dict[str, str] = {
    "hot-set": "lora_guard.policies.hot_set:HotSetPolicy",
    "cold-budget": "lora_guard.policies.cold_budget:ColdLoadBudget",
    "kv-namespace": "lora_guard.policies.kv_namespace:KVNamespacePolicy",
    "lru": "lora_guard.policies.baselines:LRUPolicy",
    "fifo": "lora_guard.policies.baselines:FIFOPolicy",
    "drain": "lora_guard.policies.drain:DrainPolicy",
    "time-slice": "lora_guard.policies.time_slice:TimeSlicePolicy",
    "s3-fifo": "lora_guard.policies.s3_fifo:S3FIFOPolicy",
    "w-tinylfu": "lora_guard.policies.w_tinylfu:WTinyLFUPolicy",
    "on-demand": "lora_guard.policies.baselines:OnDemandPolicy",
    "static": "lora_guard.policies.baselines:StaticPolicy",
}
ALWAYS_ON_PLUGINS: dict[str, str] = {"metrics": "lora_guard.metrics:MetricsPlugin"}


def parse_policies(policies: str | Iterable[str] | None) -> tuple[str, ...]:
    """Validate a ``--policies`` value: any of the guard policies, or one baseline alone."""
    if policies is None:
        return DEFAULT_POLICIES
    names = [p.strip() for p in (policies.split(",") if isinstance(policies, str) else policies)]
    names = [n for n in names if n]
    unknown = [n for n in names if n not in GUARD_POLICIES + BASELINE_POLICIES]
    if unknown:
        raise PluginError(
            f"unknown policy {unknown[0]!r}; choose from {', '.join(GUARD_POLICIES)} "
            f"or one of {', '.join(BASELINE_POLICIES)}"
        )
    baselines = [n for n in names if n in BASELINE_POLICIES]
    if baselines and len(names) > 1:
        raise PluginError(f"baseline policy {baselines[0]!r} cannot be combined with others")
    return tuple(dict.fromkeys(names))


class PluginError(RuntimeError):
    """A plugin could not be loaded or does not fit the hook contract."""


def make_plugin_manager(
    policies: str | Iterable[str] | None = None,
    plugins: Iterable[str] = (),
    disabled: Iterable[str] = (),
) -> pluggy.PluginManager:
    """A plugin manager with the chosen policies (default: the three guard policies), the
    always-on built-ins, entry-point plugins and ``plugins`` (``module[:object]``)."""
    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    for name in disabled:
        pm.set_blocked(name)
    builtins = {n: POLICY_PLUGINS[n] for n in parse_policies(policies) if n in POLICY_PLUGINS}
    builtins.update(ALWAYS_ON_PLUGINS)
    for name, target in builtins.items():
        if not pm.is_blocked(name):
            _register(pm, _load_builtin(target, name), name)
    if not os.environ.get(DISABLE_AUTOLOAD_ENV):
        try:
            pm.load_setuptools_entrypoints(ENTRY_POINT_GROUP)
        except Exception as exc:
            raise PluginError(
                f"a plugin of entry-point group {ENTRY_POINT_GROUP!r} failed to load: {exc}"
            ) from exc
    for spec in plugins:
        if pm.is_blocked(spec) or pm.has_plugin(spec):
            continue
        module_name, _, attr = spec.partition(":")
        obj = _import(module_name, f"plugin {spec!r}")
        if attr:
            try:
                obj = getattr(obj, attr)
            except AttributeError:
                raise PluginError(f"plugin {spec!r}: {module_name} has no {attr!r}") from None
        _register(pm, obj, spec)
    try:
        pm.check_pending()
    except pluggy.PluginValidationError as exc:
        raise PluginError(f"a plugin does not fit the hook contract: {exc}") from exc
    return pm


def _register(pm: pluggy.PluginManager, plugin: Any, name: str) -> None:
    if pm.is_registered(plugin):
        return  # already loaded, e.g. by entry point and named again with --plugin
    try:
        pm.register(plugin, name=name)
    except pluggy.PluginValidationError as exc:
        raise PluginError(f"plugin {name!r} does not fit the hook contract: {exc}") from exc


def _load_builtin(target: str, name: str) -> Any:
    module_name, _, attr = target.partition(":")
    obj = _import(module_name, f"built-in plugin {name}")
    if attr:
        obj = getattr(obj, attr)
        if isinstance(obj, type):
            obj = obj()
    return obj


def _import(module_name: str, what: str) -> Any:
    try:
        return importlib.import_module(module_name)
    except Exception as exc:
        raise PluginError(f"{what}: cannot import {module_name!r}: {exc}") from exc


class Hooks:
    """Typed, keyword-only calls into the plugins, one method per hook.

    A plugin that raises while deciding is a fault: it is logged and counted in ``faults``, and the
    decision falls to the engine's default. ``BusyRetry`` is a decision, not a fault.
    """

    def __init__(self, pm: pluggy.PluginManager) -> None:
        self.pm = pm
        self.faults = 0
        self.options = OptionRegistry()
        try:
            pm.hook.lora_guard_add_options.call_historic(kwargs={"options": self.options})
        except Exception as exc:
            raise PluginError(f"a plugin's options could not be added: {exc}") from exc

    def names(self) -> list[str]:
        """Names of the registered plugins (blocked ones are not listed)."""
        return sorted(name for name, plugin in self.pm.list_name_plugin() if plugin is not None)

    def has(self, hook_name: str) -> bool:
        return bool(getattr(self.pm.hook, hook_name).get_hookimpls())

    def configure(self, config: dict[str, Any]) -> None:
        merged = {**self.options.defaults(), **config}
        try:
            self.pm.hook.lora_guard_configure.call_historic(kwargs={"config": merged})
        except Exception as exc:
            raise PluginError(f"a plugin refused the configuration: {exc}") from exc

    def adapter_load(
        self,
        *,
        request: RequestView,
        tier: str,
        state: EngineState,
        parked: bool = False,
        evicts: bool = False,
    ) -> AdapterDecision | None:
        try:
            result: AdapterDecision | None = self._decide(
                self.pm.hook.lora_guard_adapter_load,
                request=request,
                tier=tier,
                state=state,
                parked=parked,
                evicts=evicts,
                busy_ok=True,
            )
        except BusyRetry as busy:
            return Reject(str(busy), busy.retry_after)
        return result

    def batch_form(
        self,
        *,
        waiting: Sequence[RequestView],
        running: Sequence[RequestView],
        state: EngineState,
    ) -> list[str] | None:
        result: list[str] | None = self._decide(
            self.pm.hook.lora_guard_batch_form, waiting=waiting, running=running, state=state
        )
        return result

    def cache_namespace(
        self, *, request: RequestView, base_model_id: str, adapter_hash: str | None
    ) -> Hashable | None:
        result: Hashable | None = self._decide(
            self.pm.hook.lora_guard_cache_namespace,
            request=request,
            base_model_id=base_model_id,
            adapter_hash=adapter_hash,
        )
        return result

    def cache_reuse(
        self, *, request: RequestView, block_scope: Hashable, request_scope: Hashable
    ) -> bool:
        return bool(
            self._decide(
                self.pm.hook.lora_guard_cache_reuse,
                request=request,
                block_scope=block_scope,
                request_scope=request_scope,
            )
        )

    def cache_evict(
        self, *, candidates: Sequence[Candidate], pages: int, purpose: str, now: float
    ) -> Sequence[Candidate] | None:
        if not self.has("lora_guard_cache_evict"):
            return None
        result: Sequence[Candidate] | None = self._decide(
            self.pm.hook.lora_guard_cache_evict,
            candidates=candidates,
            pages=pages,
            purpose=purpose,
            now=now,
        )
        return result

    def notify(self, hook_name: str, **kwargs: Any) -> None:
        """Call an observer hook; a plugin that raises is logged and counted, never fatal."""
        hook = getattr(self.pm.hook, hook_name)
        if hook.get_hookimpls():
            self._decide(hook, **kwargs)

    def _decide(self, hook: Callable[..., Any], busy_ok: bool = False, **kwargs: Any) -> Any:
        try:
            return hook(**kwargs)
        except BusyRetry:
            if busy_ok:
                raise
            self.faults += 1
            log.error(
                "plugin raised BusyRetry from %s, where it means nothing (counted)",
                getattr(hook, "name", hook),
            )
            return None
        except Exception:
            self.faults += 1
            log.exception(
                "plugin fault in %s (counted; the engine default applies)",
                getattr(hook, "name", hook),
            )
            return None
