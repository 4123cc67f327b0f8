"""The tenant-quota plugin on the real engine: a tiny random Llama and real PEFT adapters.

Run from the repository root: ``python -m pytest hooks/tenant-quota/tests``.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lora_guard_tenant_quota as tenant_quota

from lora_guard import LLM, SamplingParams
from lora_guard.demo.adapters import make_adapters
from lora_guard.demo.testing import make_tiny_llama
from lora_guard.engine import RequestOutput
from lora_guard.plugins import (
    Defer,
    EngineState,
    Hooks,
    PluginError,
    RequestView,
    SlotView,
    hookimpl,
    make_plugin_manager,
)
from lora_guard.plugins.manager import DISABLE_AUTOLOAD_ENV

PLUGIN = "lora_guard_tenant_quota"
PROMPT = "The capital of France is"
# (request id, tenant, adapter, max_new_tokens): tenant A uses two adapters, B one, for longer.
SLOT_WORKLOAD = [("a0", "A", "tq-00", 8), ("a1", "A", "tq-01", 8), ("b0", "B", "tq-02", 16)]


@pytest.fixture(autouse=True)
def only_named_plugins(monkeypatch: pytest.MonkeyPatch) -> None:
    """Load the plugin from this source tree by module name, never a second time by entry point
    (an installed copy would be registered under its entry-point name too)."""
    monkeypatch.setenv(DISABLE_AUTOLOAD_ENV, "1")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tq-model"))


@pytest.fixture(scope="module")
def adapters(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("tq-adapters")
    return {p.name: p for p in make_adapters(model_dir, out, n=3, ranks=(8,), prefix="tq")}


class RunningByTenant:
    """Records, at the start of every step, which adapters each tenant's running requests use."""

    def __init__(self) -> None:
        self.steps: list[dict[str, set[str | None]]] = []

    @hookimpl
    def lora_guard_batch_form(self, running: Sequence[RequestView]) -> None:
        per_tenant: dict[str, set[str | None]] = {}
        for view in running:
            per_tenant.setdefault(view.tenant_id, set()).add(view.adapter_id)
        self.steps.append(per_tenant)

    def most_adapters(self, tenant: str) -> int:
        return max(len(step.get(tenant, ())) for step in self.steps)

    def steps_with_both(self, *tenants: str) -> int:
        return sum(1 for step in self.steps if all(t in step for t in tenants))


def _llm(model_dir: Path, adapters: dict[str, Path], **kwargs: object) -> LLM:
    return LLM(
        model_dir,
        adapters=adapters,
        policies=(),
        plugins=[PLUGIN],
        kv_cache_memory="4MiB",
        **kwargs,
    )  # type: ignore[arg-type]


def _run(
    llm: LLM, workload: list[tuple[str, str, str | None, int]]
) -> tuple[dict[str, RequestOutput], set[str]]:
    """Submit ``workload`` with its tenants, step until all finish; also return the requests
    that computed in the first step that computed anything."""
    for request_id, tenant, adapter, n in workload:
        params = SamplingParams(max_new_tokens=n, ignore_eos=True)
        llm.engine.add_request(request_id, PROMPT, params, adapter, tenant_id=tenant)
    done: dict[str, RequestOutput] = {}
    first: set[str] = set()
    deadline = time.monotonic() + 60
    while len(done) < len(workload):
        assert time.monotonic() < deadline, "the workload did not finish"
        outputs = llm.engine.step()
        if outputs and not first:
            first = {o.request_id for o in outputs}
        done.update({o.request_id: o for o in outputs if o.finished})
        if not outputs:
            time.sleep(0.001)  # an adapter is loading
    return done, first


def test_declares_its_options_and_refuses_bad_values() -> None:
    hooks = Hooks(make_plugin_manager(policies=(), plugins=[PLUGIN]))
    assert PLUGIN in hooks.names()
    assert hooks.options.defaults()["tenant_slot_quota"] == 0
    assert hooks.options.defaults()["tenant_queue_share"] == 1.0

    hooks.configure({"tenant_slot_quota": 2, "max_num_seqs": 8})
    assert tenant_quota.quota_settings() == tenant_quota.QuotaSettings(2, 1.0, 8)
    with pytest.raises(PluginError, match=r"tenant_queue_share must be > 0 and <= 1, got 0.0"):
        hooks.configure({"tenant_queue_share": 0})
    with pytest.raises(PluginError, match="tenant_slot_quota must be 0"):
        hooks.configure({"tenant_slot_quota": -1})


def test_a_load_past_the_quota_is_deferred() -> None:
    hooks = Hooks(make_plugin_manager(policies=(), plugins=[PLUGIN]))
    hooks.configure({"tenant_slot_quota": 1})

    def view(request_id: str, tenant: str, adapter: str) -> RequestView:
        return RequestView(request_id, adapter, tenant, 5, 0, 0.0, 0)

    running = [view("r1", "A", "x")]
    state = EngineState(
        step=1,
        now=0.0,
        slots=(SlotView(0, "x", 1, 0.0), SlotView(1, None, 0, 0.0)),
        host_adapters=("y",),
        loading=frozenset(),
        memory_watermark=0.1,
        num_waiting=2,
        num_running=1,
        registered=frozenset({"x", "y"}),
    )
    waiting = [view("w1", "A", "y"), view("w2", "B", "y")]
    # The step plan leaves A's request for a second adapter out; B's goes ahead.
    assert hooks.batch_form(waiting=waiting, running=running, state=state) == ["w2"]
    # Asked anyway (another plugin may put it back), the load waits.
    decision = hooks.adapter_load(request=waiting[0], tier="warm", state=state)
    assert decision == Defer("tenant 'A' holds 1 of its 1 device slots")
    assert hooks.adapter_load(request=waiting[1], tier="warm", state=state) is None
    assert hooks.faults == 0


def _slot_rounds(
    llm: LLM, recorder: RunningByTenant
) -> list[tuple[int, int, dict[str, list[int]]]]:
    """Run the slot workload twice (adapters cold, then resident): per round, the most adapters
    tenant A used at once, the steps where A and B both ran, and the tokens."""
    llm.engine.hooks.pm.register(recorder)
    rounds = []
    try:
        for round_ in range(2):
            recorder.steps.clear()
            workload = [(f"{r}-{round_}", t, a, n) for r, t, a, n in SLOT_WORKLOAD]
            done, _ = _run(llm, workload)
            assert all(o.finish_reason == "length" for o in done.values()), done
            assert [len(done[w[0]].token_ids) for w in workload] == [8, 8, 16]
            tokens = {r.split("-")[0]: o.token_ids for r, o in done.items()}
            rounds.append((recorder.most_adapters("A"), recorder.steps_with_both("A", "B"), tokens))
    finally:
        llm.engine.hooks.pm.unregister(recorder)
    llm.engine.check_no_leaks()
    return rounds


def test_slot_quota_keeps_a_tenant_to_its_slots(model_dir: Path, adapters: dict[str, Path]) -> None:
    recorder = RunningByTenant()
    free = _slot_rounds(_llm(model_dir, adapters, max_loras=3), recorder)
    # Without a quota, tenant A holds two slots at once (round 0: cold loads; 1: resident).
    assert [most for most, _, _ in free] == [2, 2]

    capped = _slot_rounds(
        _llm(model_dir, adapters, max_loras=3, settings={"tenant_slot_quota": 1}), recorder
    )
    # With quota 1, A never holds two slots at once, cold or resident, while B keeps running
    # next to A: the quota holds A back, not B.
    assert [most for most, _, _ in capped] == [1, 1]
    assert all(both > 0 for _, both, _ in capped)
    # The quota changes when A's requests run, not what they answer.
    assert [tokens for _, _, tokens in capped] == [tokens for _, _, tokens in free]


def test_queue_share_lets_a_second_tenant_in(model_dir: Path, adapters: dict[str, Path]) -> None:
    # Three requests of A arrive before one of B; two sequences run at once.
    workload: list[tuple[str, str, str | None, int]] = [
        ("a1", "A", None, 4),
        ("a2", "A", None, 4),
        ("a3", "A", None, 4),
        ("b1", "B", None, 4),
    ]
    done, first = _run(_llm(model_dir, adapters, max_num_seqs=2), workload)
    assert first == {"a1", "a2"}  # first come, first served: B waits behind A
    assert all(o.finish_reason == "length" for o in done.values())

    llm = _llm(model_dir, adapters, max_num_seqs=2, settings={"tenant_queue_share": 0.5})
    done, first = _run(llm, workload)
    assert first == {"a1", "b1"}  # A may take half the places; B gets the other one
    assert all(o.finish_reason == "length" for o in done.values())

    # A tenant alone is not capped: the share only matters while another tenant waits.
    done, first = _run(llm, [("solo1", "A", None, 4), ("solo2", "A", None, 4)])
    assert first == {"solo1", "solo2"}
    llm.engine.check_no_leaks()
