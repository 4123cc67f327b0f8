"""The hook contract: documented, called in pluggy's order, and honoured by the real engine."""

from __future__ import annotations

import inspect
import re
import sys
import textwrap
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pluggy
import pytest

from lora_guard import LLM, SamplingParams
from lora_guard.demo.adapters import make_adapters
from lora_guard.demo.testing import reference_greedy
from lora_guard.plugins import (
    Defer,
    EngineState,
    Hooks,
    Load,
    PluginError,
    Reject,
    RequestView,
    SlotView,
    hookimpl,
    hookspecs,
    make_plugin_manager,
)
from lora_guard.plugins.manager import DISABLE_AUTOLOAD_ENV

DOCS = Path(__file__).resolve().parents[1] / "docs" / "hooks.md"
NEW_TOKENS = 5
PARAMS = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
PROMPT = "System: you are a helpful assistant. User: hello there, how are you today?"


def _hookspecs() -> dict[str, Callable[..., Any]]:
    return {
        name: func
        for name, func in inspect.getmembers(hookspecs, inspect.isfunction)
        if name.startswith("lora_guard_")
    }


HOOKS = sorted(_hookspecs())


@pytest.fixture(autouse=True)
def no_autoload(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only the plugins a test names: nothing installed in the environment joins in."""
    monkeypatch.setenv(DISABLE_AUTOLOAD_ENV, "1")


# (a) the contract is documented


def test_the_contract_has_hooks() -> None:
    assert len(HOOKS) >= 12, HOOKS
    for name, func in _hookspecs().items():
        assert hasattr(func, f"{hookspecs.PROJECT}_spec"), f"{name} is not marked @hookspec"


@pytest.mark.parametrize("name", HOOKS)
def test_plugin_hooks_are_documented(name: str) -> None:
    headings = [line for line in DOCS.read_text().splitlines() if line.startswith("#")]
    documented = [h for h in headings if re.search(rf"\b{name}\b", h)]
    assert documented, f"{name} has no heading in docs/hooks.md"


@pytest.mark.parametrize("name", HOOKS)
def test_hookspec_docstrings_follow_the_contract(name: str) -> None:
    func = _hookspecs()[name]
    doc = inspect.getdoc(func) or ""
    assert ".. versionadded::" in doc, f"{name}: no '.. versionadded::' in its docstring"
    params = list(inspect.signature(func).parameters)
    missing = [p for p in params if f":param {p}:" not in doc]
    assert not missing, f"{name}: no ':param' for {', '.join(missing)}"


# (b) the plugin manager: registration and call order


def _view(request_id: str, adapter_id: str | None = None, tenant: str = "default") -> RequestView:
    return RequestView(request_id, adapter_id, tenant, 4, 0, 0.0, 0)


STATE = EngineState(
    step=0,
    now=0.0,
    slots=(SlotView(0, None, 0, 0.0),),
    host_adapters=(),
    loading=frozenset(),
    memory_watermark=0.0,
    num_waiting=2,
    num_running=0,
)
WAITING = [_view("r1"), _view("r2")]


@pytest.fixture
def pm() -> pluggy.PluginManager:
    """A plugin manager with the contract and no plugin at all."""
    manager = make_plugin_manager(policies=(), disabled=["metrics"])
    assert manager.get_plugins() - {None} == set()  # a blocked name is listed, as None
    return manager


class Answer:
    """Answers ``lora_guard_batch_form`` with ``[name]`` and logs the observer calls it gets."""

    def __init__(self, name: str, log: list[str]) -> None:
        self.name, self.log = name, log

    @hookimpl
    def lora_guard_batch_form(self) -> list[str]:
        self.log.append(self.name)
        return [self.name]

    @hookimpl
    def lora_guard_adapter_evicted(self) -> None:
        self.log.append(f"{self.name} saw the eviction")


class TryFirst(Answer):
    @hookimpl(tryfirst=True)
    def lora_guard_batch_form(self) -> list[str]:
        return super().lora_guard_batch_form()


class NoOpinion(Answer):
    @hookimpl(trylast=True)
    def lora_guard_batch_form(self) -> None:
        self.log.append(self.name)


class Wrapper:
    @hookimpl(wrapper=True)
    def lora_guard_batch_form(self) -> Iterator[None]:
        order = yield
        return [*(order or []), "wrapped"]


def _batch_form(pm: pluggy.PluginManager) -> list[str] | None:
    return Hooks(pm).batch_form(waiting=WAITING, running=[], state=STATE)


def test_last_registered_decides_and_observers_all_hear(pm: pluggy.PluginManager) -> None:
    log: list[str] = []
    first, second = Answer("first", log), Answer("second", log)
    pm.register(first)
    pm.register(second)
    try:
        assert _batch_form(pm) == ["second"]
        assert log == ["second"], "a firstresult hook went on after an answer"
        log.clear()
        Hooks(pm).notify("lora_guard_adapter_evicted", adapter_id="x", slot=0)
        assert log == ["second saw the eviction", "first saw the eviction"]
    finally:
        pm.unregister(first)
        pm.unregister(second)
    assert _batch_form(pm) is None, "an unregistered plugin still answers"


def test_tryfirst_wins_and_wrappers_see_the_answer(pm: pluggy.PluginManager) -> None:
    log: list[str] = []
    eager, late, last = TryFirst("eager", log), Answer("late", log), NoOpinion("last", log)
    plugins = [eager, late, last, Wrapper()]
    try:
        for plugin in plugins:
            pm.register(plugin)
        # Registered first, but tryfirst: it answers, and the wrapper sees its answer.
        assert _batch_form(pm) == ["eager", "wrapped"]
        assert log == ["eager"]
        pm.unregister(eager)
        log.clear()
        # Registered after "late", but trylast: "late" answers first.
        assert _batch_form(pm) == ["late", "wrapped"]
        assert log == ["late"]
        pm.unregister(late)
        log.clear()
        # Nobody has an opinion: the wrapper sees None.
        assert _batch_form(pm) == ["wrapped"]
        assert log == ["last"]
    finally:
        for plugin in plugins:
            if pm.is_registered(plugin):
                pm.unregister(plugin)


def test_a_raising_plugin_is_a_counted_fault(pm: pluggy.PluginManager) -> None:
    class Broken:
        @hookimpl
        def lora_guard_batch_form(self) -> list[str]:
            raise RuntimeError("bug in a plugin")

    plugin = Broken()
    pm.register(plugin)
    try:
        hooks = Hooks(pm)
        assert hooks.batch_form(waiting=WAITING, running=[], state=STATE) is None
        assert hooks.faults == 1
    finally:
        pm.unregister(plugin)


# (c) through the real engine


@pytest.fixture(scope="module")
def adapters(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("plugin-adapters")
    return {
        p.name: p
        for p in make_adapters(tiny_model, out, n=2, ranks=(8,), strength=0.5, prefix="pl")
    }


def _llm(tiny_model: Path, adapters: dict[str, Path], **kwargs: Any) -> LLM:
    return LLM(tiny_model, adapters=adapters, policies=(), kv_cache_memory="4MiB", **kwargs)


class Registered:
    """Plugins on a live engine for the length of a ``with`` block."""

    def __init__(self, llm: LLM, *plugins: object) -> None:
        self.pm, self.plugins = llm.engine.hooks.pm, plugins

    def __enter__(self) -> None:
        for plugin in self.plugins:
            self.pm.register(plugin)

    def __exit__(self, *exc: object) -> None:
        for plugin in self.plugins:
            self.pm.unregister(plugin)


def test_reject_fails_that_request_only(tiny_model: Path, adapters: dict[str, Path]) -> None:
    class RejectAdapter:
        @hookimpl
        def lora_guard_adapter_load(self, request: RequestView) -> Reject | None:
            return Reject("busy", 2.5) if request.adapter_id == "pl-00" else None

    llm = _llm(tiny_model, adapters)
    llm.engine.scheduler.reject_when_busy = True  # as a server's engine: busy answers fail
    with Registered(llm, RejectAdapter()):
        rejected, base = llm.generate([PROMPT, PROMPT], PARAMS, ["pl-00", None])
    assert (rejected.finish_reason, rejected.error, rejected.retry_after) == ("error", "busy", 2.5)
    assert rejected.token_ids == []
    assert base.finish_reason == "length" and len(base.token_ids) == NEW_TOKENS
    assert llm.engine.hooks.faults == 0, "a rejection is a decision, not a fault"
    # Without the plugin the same adapter serves.
    assert llm.generate(PROMPT, PARAMS, "pl-00")[0].finish_reason == "length"
    llm.engine.check_no_leaks()


def test_defer_then_load_completes(tiny_model: Path, adapters: dict[str, Path]) -> None:
    class DeferThenLoad:
        def __init__(self) -> None:
            self.asked: list[tuple[int, str, object]] = []

        @hookimpl
        def lora_guard_adapter_load(self, tier: str, state: EngineState) -> Defer | Load:
            decision = Defer("not yet") if len(self.asked) < 3 else Load()
            self.asked.append((state.step, tier, decision))
            return decision

    llm = _llm(tiny_model, adapters)
    plugin = DeferThenLoad()
    with Registered(llm, plugin):
        deferred = llm.generate(PROMPT, PARAMS, "pl-01")[0]
    assert deferred.finish_reason == "length" and len(deferred.token_ids) == NEW_TOKENS
    steps = [step for step, _, decision in plugin.asked if isinstance(decision, Defer)]
    assert len(set(steps)) == 3, f"asked again at each step: {plugin.asked}"
    assert plugin.asked[3] == (steps[-1] + 1, "cold", Load())
    # Waiting changed when it ran, not what it answered.
    assert llm.generate(PROMPT, PARAMS, "pl-01")[0].token_ids == deferred.token_ids
    llm.engine.check_no_leaks()


def test_batch_form_decides_who_goes_first(tiny_model: Path, adapters: dict[str, Path]) -> None:
    class Reverse:
        @hookimpl
        def lora_guard_batch_form(self, waiting: Sequence[RequestView]) -> list[str]:
            return [view.request_id for view in reversed(waiting)]

    class FinishOrder:
        def __init__(self) -> None:
            self.ids: list[str] = []

        @hookimpl
        def lora_guard_request_finished(self, request: RequestView) -> None:
            self.ids.append(request.request_id)

    llm = _llm(tiny_model, adapters, max_num_seqs=1)
    prompts = ["The quick brown fox", "Numbers: 0 1 2", "The capital of Italy"]
    finished = FinishOrder()
    with Registered(llm, finished):
        fifo = [o.request_id for o in llm.generate(prompts, PARAMS)]
        assert finished.ids == fifo
        finished.ids.clear()
        with Registered(llm, Reverse()):
            reverse = [o.request_id for o in llm.generate(prompts, PARAMS)]
        assert finished.ids == reverse[::-1]
    llm.engine.check_no_leaks()


def test_a_raising_plugin_never_stops_a_request(
    tiny_model: Path, adapters: dict[str, Path]
) -> None:
    class Broken:
        @hookimpl
        def lora_guard_adapter_load(self) -> None:
            raise RuntimeError("bug in adapter_load")

        @hookimpl
        def lora_guard_batch_form(self) -> None:
            raise RuntimeError("bug in batch_form")

        @hookimpl
        def lora_guard_step_finished(self) -> None:
            raise RuntimeError("bug in an observer")

    llm = _llm(tiny_model, adapters)
    with Registered(llm, Broken()):
        out = llm.generate(PROMPT, PARAMS, "pl-00")[0]
    assert llm.engine.hooks.faults >= 3
    assert out.finish_reason == "length" and out.error is None
    # The engine's defaults applied: the same answer as with no plugin.
    assert llm.generate(PROMPT, PARAMS, "pl-00")[0].token_ids == out.token_ids
    llm.engine.check_no_leaks()


class SharedNamespace:
    @hookimpl
    def lora_guard_cache_namespace(self) -> str:
        return "one namespace for every adapter"


class ReuseAnyway:
    @hookimpl
    def lora_guard_cache_reuse(self) -> bool:
        return True


def test_cache_namespace_and_reuse(tiny_model: Path, adapters: dict[str, Path]) -> None:
    llm = _llm(tiny_model, adapters, block_size=4)
    stats = llm.engine.blocks.stats
    refused_prompt = llm.tokenizer.encode(PROMPT)
    reused_prompt = llm.tokenizer.encode("The quick brown fox jumps over the lazy dog. Pack my box")
    assert len(refused_prompt) >= 12 and len(reused_prompt) >= 12

    with Registered(llm, SharedNamespace()):
        # Shared namespace, default answer: the conflict is counted, the block refused.
        llm.generate(refused_prompt, PARAMS, "pl-00")
        before = stats.conflicts
        refused = llm.generate(refused_prompt, PARAMS, "pl-01")[0]
        assert stats.conflicts > before
        assert refused.num_cached_tokens == 0
        oracle = reference_greedy(tiny_model, [(refused_prompt, adapters["pl-01"])], NEW_TOKENS)
        assert refused.token_ids == oracle[0]

        # With cache_reuse answering True, adapter pl-01 reuses KV that pl-00 computed.
        with Registered(llm, ReuseAnyway()):
            llm.generate(reused_prompt, PARAMS, "pl-00")
            before = stats.conflicts
            reused = llm.generate(reused_prompt, PARAMS, "pl-01")[0]
        assert reused.num_cached_tokens > 0
        assert stats.conflicts > before
    llm.engine.check_no_leaks()


def test_an_unknown_plugin_module_is_a_clear_error(tiny_model: Path) -> None:
    with pytest.raises(PluginError, match=r"plugin 'no\.such\.module': cannot import 'no\.such"):
        LLM(tiny_model, policies=(), plugins=["no.such.module"], kv_cache_memory="4MiB")


@pytest.fixture
def plugin_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., str]]:
    """Write a plugin module that ``plugins=[name]`` can import; forget it afterwards."""
    monkeypatch.syspath_prepend(str(tmp_path))
    names: list[str] = []

    def write(name: str, source: str) -> str:
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
        names.append(name)
        return name

    yield write
    for name in names:
        sys.modules.pop(name, None)


@pytest.mark.parametrize(
    ("source", "message"),
    [
        (
            "def lora_guard_adapter_load(request, adapter_name):\n    return None\n",
            r"does not fit the hook contract.*adapter_name",
        ),
        (
            "def lora_guard_adapter_laod(request):\n    return None\n",
            r"does not fit the hook contract.*lora_guard_adapter_laod",
        ),
    ],
    ids=["unknown-argument", "unknown-hook"],
)
def test_a_plugin_off_the_contract_fails_at_start_up(
    tiny_model: Path, plugin_module: Callable[..., str], source: str, message: str, request: Any
) -> None:
    name = plugin_module(
        f"lg_off_contract_{request.node.callspec.id.replace('-', '_')}",
        "from lora_guard.plugins import hookimpl\n\n@hookimpl\n" + source,
    )
    with pytest.raises(PluginError, match=re.compile(message, re.S)):
        LLM(tiny_model, policies=(), plugins=[name], kv_cache_memory="4MiB")


def test_configure_gets_settings_and_option_defaults(
    tiny_model: Path, plugin_module: Callable[..., str]
) -> None:
    name = plugin_module(
        "lg_probe_plugin",
        """
        from lora_guard.plugins import hookimpl

        SEEN = []

        @hookimpl
        def lora_guard_add_options(options):
            options.add("probe_level", int, 3, "how deep to probe")
            options.add("probe_label", str, "plain", "what to call it")

        @hookimpl
        def lora_guard_configure(config):
            SEEN.append(dict(config))
        """,
    )
    llm = LLM(
        tiny_model,
        policies=(),
        plugins=[name],
        kv_cache_memory="4MiB",
        max_loras=3,
        settings={"probe_label": "custom"},
    )
    plugin = llm.engine.hooks.pm.get_plugin(name)
    assert len(plugin.SEEN) == 1
    config = plugin.SEEN[0]
    assert config["probe_level"] == 3  # the declared default
    assert config["probe_label"] == "custom"  # LLM(settings=...)
    assert config["max_loras"] == 3  # the engine's own settings
    assert llm.engine.hooks.options.options["probe_level"].help == "how deep to probe"
    assert llm.generate(PROMPT, PARAMS)[0].finish_reason == "length"
    llm.engine.check_no_leaks()
