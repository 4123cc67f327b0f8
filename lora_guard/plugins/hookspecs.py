"""The hook contract of lora-guard (pluggy project name ``lora_guard``).

A plugin is a module or object with functions marked ``@lora_guard.hookimpl`` and named after the
specs below. Deciding hooks are ``firstresult``: the first plugin that returns something other
than None decides, in pluggy's call order (last registered first; ``tryfirst``/``trylast`` move
a plugin).
Observer hooks return nothing and are called on every plugin. The engine always calls hooks with
keyword arguments, so an implementation may accept any subset of a spec's arguments.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import pluggy

from lora_guard.plugins.decisions import AdapterDecision
from lora_guard.plugins.eviction import Candidate
from lora_guard.plugins.options import OptionRegistry
from lora_guard.plugins.state import EngineState, RequestView

PROJECT = "lora_guard"
hookspec = pluggy.HookspecMarker(PROJECT)


# start-up


@hookspec(historic=True)
def lora_guard_add_options(options: OptionRegistry) -> None:
    """Declare the plugin's own settings (they become ``--flags``, ``LORA_GUARD_*`` variables and
    config-file keys).

    :param options: call ``options.add(name, type, default, help)`` for each setting.

    Historic: a plugin registered late still gets the call.

    .. versionadded:: 0.1
    """


@hookspec(historic=True)
def lora_guard_configure(config: dict[str, Any]) -> None:
    """Read the settings once they are final, before the engine serves anything.

    :param config: every setting by name (underscored), the plugins' own included.

    Historic. Raise to refuse to start; the message is shown to the operator.

    .. versionadded:: 0.1
    """


# decisions


@hookspec(firstresult=True)
def lora_guard_adapter_load(
    request: RequestView, tier: str, state: EngineState, parked: bool, evicts: bool
) -> AdapterDecision | None:
    """A request needs an adapter that is not in the pool.

    :param request: the request.
    :param tier: ``"warm"`` (the adapter is in host memory and needs a seat and pages in the
        pool) or ``"cold"`` (it must be read from disk first; the read runs on the loader thread).
    :param state: the engine between steps.
    :param parked: the request is running and its adapter left the pool (it waits with its KV
        kept); a ``Reject`` is then taken as ``Defer``: a running request is never failed for a
        policy.
    :param evicts: loading it now (a warm adapter) must evict an adapter that requests still
        need (thrash): neither free seats and pages nor those of adapters no request needs are
        enough.
    :return: ``Load(slot, evict)`` to go ahead (for a warm adapter, into seat ``slot``, evicting
        what is there if the engine lets it leave now, None letting the engine choose; when pages
        are short, then the adapters of the seats ``evict`` names), ``Defer()`` to wait a
        step, ``Reject(reason, retry_after)`` to fail the request with ``BusyRetry``, or None to
        leave it to the next plugin (the engine's default: load, evicting an adapter no request
        needs, else the one resident longest whose quantum is over).

    Firstresult. Called again at each step until the adapter is resident or the request rejected.
    The offline ``LLM.generate`` takes ``Reject`` as ``Defer``: a batch waits, never drops.

    .. versionadded:: 0.1
    .. versionchanged:: 0.2 ``parked`` and ``evicts``; called for parked running requests too.
    .. versionchanged:: 0.3 ``Load.evict``.
    """


@hookspec(firstresult=True)
def lora_guard_batch_form(
    waiting: Sequence[RequestView], running: Sequence[RequestView], state: EngineState
) -> list[str] | None:
    """The scheduler builds the next step: which waiting requests may start, in what order.

    :param waiting: requests waiting to start, oldest first.
    :param running: requests already running (they keep their place).
    :param state: the engine between steps.
    :return: request ids of ``waiting`` to offer a place, in order; ids left out wait this step.
        None: first come, first served.

    Firstresult. Requests offered a place still need room in the token budget and KV pool.

    .. versionadded:: 0.1
    """


@hookspec(firstresult=True)
def lora_guard_cache_namespace(
    request: RequestView, base_model_id: str, adapter_hash: str | None
) -> Hashable | None:
    """The namespace mixed into the prefix-cache keys of the request's KV blocks: only requests
    with equal namespaces share cached blocks.

    :param request: the request being admitted.
    :param base_model_id: the base model's id.
    :param adapter_hash: sha256 of the adapter's files, None for the base model.
    :return: a hashable namespace, or None for the default ``(base model, adapter id, adapter
        hash)``.

    Firstresult.

    .. versionadded:: 0.1
    """


@hookspec(firstresult=True)
def lora_guard_cache_reuse(
    request: RequestView, block_scope: Hashable, request_scope: Hashable
) -> bool | None:
    """A cached block matched the request's namespace and tokens, but its KV was computed under
    other weights (``block_scope`` differs from ``request_scope``). This is always counted as a
    ``kv_namespace_conflict``.

    :param request: the request being admitted.
    :param block_scope: the ``CacheScope`` (``base_model``, ``adapter_id``, ``adapter_hash``) that
        computed the block.
    :param request_scope: the same for the request.
    :return: True to reuse the block anyway (observe mode, to show the hazard), False or None to
        refuse it.

    Firstresult.

    .. versionadded:: 0.1
    """


@hookspec(firstresult=True)
def lora_guard_cache_evict(
    candidates: Sequence[Candidate], pages: int, purpose: str, now: float
) -> Sequence[Candidate] | None:
    """The cache pool needs pages and its empty ones are too few: order what may give pages
    back, cached prefix blocks and resident adapters alike.

    :param candidates: every cached prefix block no request holds (but those the asking request
        reuses) and every resident adapter the engine lets leave now that no request needs
        (``Candidate``: kind, pages, last use, uses, the cost to bring it back by the engine's
        own step records, its adapter, its place in its chain). Pinned adapters, adapters a
        step computes with and blocks a request holds are never offered.
    :param pages: how many pages are short.
    :param purpose: ``"kv"`` (a request's KV) or ``"adapter"`` (an adapter's weights).
    :param now: the engine's clock.
    :return: candidates, most expendable first; the engine frees them in that order until
        enough pages are empty. Those left out stay, except that KV in use that still has no
        room then takes cached blocks least recently used first. None: the next plugin, else
        the engine's default, least recently used first over both kinds (S-LoRA's unified
        pool).

    Firstresult. Called on the step loop, only when empty pages run short.

    .. versionadded:: 0.4
    """


# observers


@hookspec
def lora_guard_adapter_loaded(
    adapter_id: str, slot: int, tier: str, swap_ms: float, read_ms: float
) -> None:
    """An adapter is ready in a device slot.

    :param adapter_id: the adapter.
    :param slot: the device slot it is in.
    :param tier: ``"warm"`` (from host memory) or ``"cold"`` (read from disk).
    :param swap_ms: from the start of the load to the slot being ready.
    :param read_ms: the part of ``swap_ms`` spent reading it from disk into host memory (0 for a
        warm load, and where the read is not timed apart); the rest is its copy into the slot.

    .. versionadded:: 0.1
    .. versionchanged:: 0.5 ``read_ms``.
    """


@hookspec
def lora_guard_adapter_ready(request: RequestView, wait_ms: float) -> None:
    """A request's adapter is usable: it is resident and the request computes with it this step.

    :param request: the request.
    :param wait_ms: milliseconds from when the request first needed its adapter and found it
        out of the pool (at admission, or when parked) to now; 0 when it was resident already.
        Called at admission and after each time the request was parked.

    .. versionadded:: 0.2
    """


@hookspec
def lora_guard_adapter_evicted(adapter_id: str, slot: int) -> None:
    """An adapter left a device slot to make room for another.

    :param adapter_id: the adapter that left.
    :param slot: the slot it left.

    .. versionadded:: 0.1
    """


@hookspec
def lora_guard_adapter_lookup(request: RequestView, result: str) -> None:
    """A request looked for its adapter, once per request.

    :param request: the request.
    :param result: ``"hot"`` (in a device slot), ``"warm"`` (in host memory) or ``"cold"`` (on
        disk). A request whose adapter is being read for another request is looked up once the
        read is done.

    .. versionadded:: 0.1
    """


@hookspec
def lora_guard_adapter_load_failed(adapter_id: str, error: str) -> None:
    """Reading an adapter from disk failed (corrupt, missing, refused); its waiting requests fail.

    :param adapter_id: the adapter.
    :param error: why, naming the adapter.

    .. versionadded:: 0.1
    """


@hookspec
def lora_guard_request_finished(
    request: RequestView,
    finish_reason: str,
    error: str | None,
    retry_after: float | None,
    num_cached_tokens: int,
) -> None:
    """A request ended.

    :param request: the request.
    :param finish_reason: ``length``, ``eos_token``, ``stop_sequence``, ``error`` or ``abort``.
    :param error: why it failed, for ``error``.
    :param retry_after: set when a policy rejected it with ``BusyRetry``.
    :param num_cached_tokens: prompt tokens served from the prefix cache.

    .. versionadded:: 0.1
    """


@hookspec
def lora_guard_step_finished(
    state: EngineState, num_tokens: int, duration_s: float, kv_conflicts: int, cached_tokens: int
) -> None:
    """A step ran.

    :param state: the engine after the step.
    :param num_tokens: tokens computed in the step.
    :param duration_s: wall time of the step, seconds.
    :param kv_conflicts: prefix-cache conflicts counted so far (cumulative).
    :param cached_tokens: prompt tokens served from the prefix cache so far (cumulative).

    .. versionadded:: 0.1
    """
