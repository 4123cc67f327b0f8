"""A test plugin that injects faults into a real ``lora-guard serve``, triggered by the tenant.

Load it with ``--plugin faults:injector`` and this folder on ``PYTHONPATH``. Requests of these
tenants (``X-Tenant-Id``) trigger it; every other request is left alone:

- ``fault-step``: the model forward of any step holding such a request raises, as a device error
  would. The engine contains it: that step's requests fail with 424, the loop goes on.
- ``fault-loop``: the scheduler raises while such a request waits, which kills the engine loop
  (an exception outside the forward pass means the engine's own state may be broken).
- ``fault-plugin``: this plugin's own ``batch_form`` hook raises. The hook layer contains plugin
  faults by design: logged, counted, the engine's default applies and the request is served.
- ``busy``: this plugin answers its adapter loads with ``Reject`` (busy, retry after 2.5 s), as a
  spent load budget would: the request gets 429 with ``Retry-After: 3``.
- ``hold``: waiting requests stay waiting (``batch_form`` leaves them out) while the file named
  by ``$FAULTS_HOLD_FILE`` exists, so a test can keep requests in flight as long as it
  needs; the number held is written to that name plus ``.count``.

The first two reach below the plugin API on purpose: no hook can break a step (that is the point
of the hook layer), so the plugin wraps ``ModelRunner.run`` and ``Scheduler.schedule`` when the
server configures it. Nothing here runs unless a request names one of these tenants.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from lora_guard import hookimpl
from lora_guard.engine.runner import ModelRunner
from lora_guard.engine.scheduler import Scheduler
from lora_guard.plugins import Reject
from lora_guard.plugins.state import RequestView

STEP_FAULT = "fault-step"
LOOP_FAULT = "fault-loop"
PLUGIN_FAULT = "fault-plugin"
HOLD = "hold"
BUSY = "busy"
HOLD_FILE_ENV = "FAULTS_HOLD_FILE"


class InjectedFault(RuntimeError):
    """Raised by this plugin, never by lora-guard itself."""


def _wrap_run(run: Callable[..., Any]) -> Callable[..., Any]:
    def run_with_faults(self: ModelRunner, plan: Any) -> Any:
        if any(item.seq.tenant_id == STEP_FAULT for item in plan.scheduled):
            raise InjectedFault("injected fault: the forward pass failed")
        return run(self, plan)

    run_with_faults.injected = True  # type: ignore[attr-defined]
    return run_with_faults


def _wrap_schedule(schedule: Callable[..., Any]) -> Callable[..., Any]:
    def schedule_with_faults(self: Scheduler) -> Any:
        if any(seq.tenant_id == LOOP_FAULT for seq in [*self.waiting, *self.running]):
            raise InjectedFault("injected fault: the scheduler broke")
        return schedule(self)

    schedule_with_faults.injected = True  # type: ignore[attr-defined]
    return schedule_with_faults


class FaultInjector:
    def __init__(self) -> None:
        self.held = 0

    @hookimpl
    def lora_guard_configure(self) -> None:
        if not getattr(ModelRunner.run, "injected", False):
            ModelRunner.run = _wrap_run(ModelRunner.run)  # type: ignore[method-assign]
        if not getattr(Scheduler.schedule, "injected", False):
            Scheduler.schedule = _wrap_schedule(Scheduler.schedule)  # type: ignore[method-assign]

    @hookimpl(tryfirst=True)
    def lora_guard_adapter_load(self, request: RequestView) -> Reject | None:
        if request.tenant_id == BUSY:
            return Reject(f"adapter {request.adapter_id!r}: busy (injected)", 2.5)
        return None

    @hookimpl
    def lora_guard_batch_form(self, waiting: Sequence[RequestView]) -> list[str] | None:
        if any(r.tenant_id == PLUGIN_FAULT for r in waiting):
            raise InjectedFault("injected fault: a plugin's batch_form raised")
        hold_file = os.environ.get(HOLD_FILE_ENV)
        held = [r for r in waiting if r.tenant_id == HOLD]
        if hold_file and held and Path(hold_file).exists():
            if len(held) != self.held:
                self.held = len(held)
                Path(hold_file + ".count").write_text(str(self.held))
            return [r.request_id for r in waiting if r.tenant_id != HOLD]
        return None  # the other plugins decide


injector = FaultInjector()
