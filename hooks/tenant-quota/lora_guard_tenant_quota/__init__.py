"""lora-guard-tenant-quota: per-tenant caps on device slots and on each step's places.

Two settings, both off by default:

``tenant_slot_quota`` (int, 0 = off)
    The most device slots one tenant's adapters may hold at once. A tenant *holds* a slot while
    one of its running requests uses the adapter in it (a slot shared by two tenants counts for
    both). A waiting request that would make its tenant hold more slots waits until one of the
    tenant's slots is let go: its requests there finish.

``tenant_queue_share`` (float in (0, 1], 1.0 = off)
    The largest share of one step's places that one tenant may take, while another tenant is
    waiting too. A step's places are the waiting requests offered a place, at most the free
    sequence places (``max_num_seqs`` minus the running requests). A tenant's requests beyond
    ``max(1, floor(share * places))`` wait for the next step.

A tenant with nothing running always keeps its first waiting request, so no tenant starves.

How the plugin knows who uses what: at the start of each step the scheduler passes the running
requests (with their tenant and adapter) to ``lora_guard_batch_form``; this plugin wraps that hook,
records them, and plans the step: it leaves out the requests that would break either cap. Its
``lora_guard_adapter_load`` checks the slot quota again when a load is decided (with the live
slots), so a load stays within the quota even if an outer batch-form wrapper brings a request back.
The planning in batch-form matters because the engine binds a request whose adapter already sits
in a slot without asking ``lora_guard_adapter_load``.

The plugin is this module (the entry point loads it and pluggy registers it), so its state is the
module's: one engine per process, as ``lora-guard serve`` runs. ``lora_guard_configure`` resets it.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Generator, Sequence
from dataclasses import dataclass, field
from typing import Any

from lora_guard.plugins import Defer, EngineState, RequestView, hookimpl
from lora_guard.plugins.options import OptionRegistry

__version__ = "0.1.0"

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class QuotaSettings:
    """The plugin's settings, as read by ``lora_guard_configure``."""

    slot_quota: int = 0
    queue_share: float = 1.0
    max_num_seqs: int | None = None


@dataclass
class _Step:
    """What the plugin knows in the current step."""

    # tenant -> adapters its running requests use, plus loads allowed during the step
    tenant_adapters: dict[str, set[str]] = field(default_factory=dict)


_settings = QuotaSettings()
_step = _Step()


def quota_settings() -> QuotaSettings:
    """The settings in force (for operators and tests: check what the plugin read)."""
    return _settings


@hookimpl
def lora_guard_add_options(options: OptionRegistry) -> None:
    options.add(
        "tenant_slot_quota",
        int,
        0,
        "the most device slots one tenant's adapters may hold at once (0: no quota)",
    )
    options.add(
        "tenant_queue_share",
        float,
        1.0,
        "the largest share of one step's places one tenant may take (1.0: no cap)",
    )


@hookimpl
def lora_guard_configure(config: dict[str, Any]) -> None:
    global _settings, _step
    quota = int(config.get("tenant_slot_quota", 0))
    share = float(config.get("tenant_queue_share", 1.0))
    if quota < 0:
        raise ValueError(f"tenant_slot_quota must be 0 (off) or a number of slots, got {quota}")
    if not 0 < share <= 1:
        raise ValueError(f"tenant_queue_share must be > 0 and <= 1, got {share}")
    max_num_seqs = config.get("max_num_seqs")
    _settings = QuotaSettings(quota, share, int(max_num_seqs) if max_num_seqs else None)
    _step = _Step()


@hookimpl(tryfirst=True)
def lora_guard_adapter_load(request: RequestView, state: EngineState) -> Defer | None:
    """Defer a load that would make the request's tenant hold more than its slot quota;
    otherwise None, so the other plugins (or the engine's default) decide."""
    quota = _settings.slot_quota
    if quota <= 0 or request.adapter_id is None:
        return None
    tenant = request.tenant_id
    held = _held_slots(tenant, state)
    if len(held) >= quota:
        return Defer(f"tenant {tenant!r} holds {len(held)} of its {quota} device slots")
    _step.tenant_adapters.setdefault(tenant, set()).add(request.adapter_id)
    return None


@hookimpl(wrapper=True)
def lora_guard_batch_form(
    waiting: Sequence[RequestView], running: Sequence[RequestView], state: EngineState
) -> Generator[None, list[str] | None, list[str] | None]:
    """Wrap the other plugins' order (None: first come, first served) and leave out the requests
    that would break the slot quota or the queue share this step."""
    _step.tenant_adapters = {}
    for view in running:
        if view.adapter_id is not None:
            _step.tenant_adapters.setdefault(view.tenant_id, set()).add(view.adapter_id)
    order = yield
    if _settings.slot_quota <= 0 and _settings.queue_share >= 1:
        return order
    by_id = {view.request_id: view for view in waiting}
    ids = [view.request_id for view in waiting] if order is None else list(order)
    kept = _within_slot_quota(ids, by_id)
    kept = _within_queue_share(kept, by_id, running)
    if len(kept) < len(ids):
        log.debug(
            "tenant-quota: %d of %d waiting requests wait a step", len(ids) - len(kept), len(ids)
        )
    return kept if order is not None or len(kept) < len(ids) else None


def _held_slots(tenant: str, state: EngineState) -> set[int]:
    """Slots whose adapter one of ``tenant``'s running requests uses (as far as the plugin knows:
    the running requests at the start of the step, and the loads it allowed since)."""
    adapters = _step.tenant_adapters.get(tenant, set())
    return {view.slot for view in state.slots if view.refs > 0 and view.adapter_id in adapters}


def _within_slot_quota(ids: list[str], by_id: dict[str, RequestView]) -> list[str]:
    """Keep a request if its tenant already uses its adapter, or if the tenant may take one more
    adapter within its quota (counting those this plan has already let in)."""
    quota = _settings.slot_quota
    if quota <= 0:
        return ids
    planned = {t: set(adapters) for t, adapters in _step.tenant_adapters.items()}
    kept = []
    for request_id in ids:
        view = by_id.get(request_id)
        if view is None or view.adapter_id is None:
            kept.append(request_id)
            continue
        adapters = planned.setdefault(view.tenant_id, set())
        if view.adapter_id in adapters or len(adapters) < quota:
            adapters.add(view.adapter_id)
            kept.append(request_id)
    return kept


def _within_queue_share(
    ids: list[str], by_id: dict[str, RequestView], running: Sequence[RequestView]
) -> list[str]:
    """Keep at most ``max(1, floor(share * places))`` requests per tenant while two or more
    tenants are waiting; the first of each tenant always stays."""
    share = _settings.queue_share
    tenants = [by_id[i].tenant_id if i in by_id else None for i in ids]
    if share >= 1 or len(set(tenants)) < 2:
        return ids
    places = len(ids)
    if _settings.max_num_seqs is not None:
        places = min(places, max(_settings.max_num_seqs - len(running), 1))
    cap = max(1, int(share * places + 1e-9))
    taken: Counter[str | None] = Counter()
    kept = []
    for request_id, tenant in zip(ids, tenants, strict=True):
        if taken[tenant] < cap:
            taken[tenant] += 1
            kept.append(request_id)
    return kept
