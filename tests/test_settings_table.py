"""The settings table and everything made from it agree: each field of ``EngineConfig`` that users
set is a setting of ``lora-guard serve`` (a flag, a variable and a TOML key), an ``LLM`` keyword
with the same default, and a row of the docs; each setting is read from all three sources."""

from __future__ import annotations

import argparse
import inspect
from collections.abc import Callable
from dataclasses import MISSING, fields
from pathlib import Path
from typing import Any

import pytest

from lora_guard import LLM, cli, simulate
from lora_guard.bench import engine as bench_engine
from lora_guard.bench import virtual_time
from lora_guard.config import SETTINGS, Setting, add_engine_flags, build_parser, load_settings
from lora_guard.engine.config import EngineConfig, user_fields
from lora_guard.plugins.manager import DISABLE_AUTOLOAD_ENV
from lora_guard.settings_docs import DOCS_TABLES, with_generated_table

DOCS = Path(__file__).parents[1] / "docs"
LLM_OWN = {
    "adapter_dir",
    "adapters",
    "policies",
    "plugins",
    "disabled_plugins",
    "settings",
    "clock",
}
BY_FIELD = {s.engine_field: s for s in SETTINGS if s.engine_field is not None}
# Read before the plugins load; test_config.py covers them.
PHASE_ONE = {"config", "policies", "plugin", "disable_plugin"}


def test_every_engine_field_users_set_is_a_setting_with_its_default() -> None:
    internal = {f.name for f in fields(EngineConfig)} - {f.name for f in user_fields()}
    assert internal == {"lora_mode", "static_adapter", "reject_when_busy", "clock"}
    assert set(BY_FIELD) == {f.name for f in user_fields()}
    for f in user_fields():
        setting = BY_FIELD[f.name]
        default = None if f.default is MISSING else f.default
        assert (not setting.default if setting.invert else setting.default) == default, f.name
    assert BY_FIELD["enable_prefix_caching"].flag == "--no-prefix-caching"
    assert BY_FIELD["max_model_len"].flag == "--max-total-tokens"


def test_llm_keywords_are_the_engine_fields_with_their_defaults() -> None:
    params = dict(inspect.signature(LLM.__init__).parameters)
    del params["self"]
    assert set(params) - LLM_OWN == {f.name for f in user_fields()}
    for f in user_fields():
        expected = inspect.Parameter.empty if f.default is MISSING else f.default
        assert params[f.name].default == expected, f.name
        assert f":param {f.name}: " in (LLM.__doc__ or ""), f.name


def test_the_parser_has_every_flag_with_its_variable() -> None:
    parser = build_parser(None)
    actions = {a.option_strings[0]: a for a in parser._actions if a.option_strings}
    for setting in SETTINGS:
        action = actions[setting.flag]
        assert action.dest == setting.name
        assert f"env {setting.env}" in (action.help or ""), setting.name
        assert isinstance(action, argparse._StoreTrueAction) is setting.switch, setting.name


@pytest.mark.parametrize("name", sorted(DOCS_TABLES))
def test_the_docs_tables_are_the_generated_ones(name: str) -> None:
    doc = (DOCS / name).read_text()
    assert with_generated_table(name, doc) == doc, (
        f"docs/{name} is out of date: python -m lora_guard.settings_docs --write-docs docs"
    )


def _sample(setting: Setting) -> str:
    """A value of ``setting`` as text: its default where it has one, else a small one."""
    if setting.switch:
        return "true"
    if setting.default not in (None, (), {}):
        return setting.shown_default()
    return "x=/p" if setting.name == "adapter" else "3"


@pytest.mark.parametrize("source", ["flag", "env", "file"])
@pytest.mark.parametrize(
    "setting", [s for s in SETTINGS if s.name not in PHASE_ONE], ids=lambda s: s.name
)
def test_every_setting_is_read_from_its_flag_variable_and_key(
    tmp_path: Path, setting: Setting, source: str
) -> None:
    raw = _sample(setting)
    argv: list[str] = []
    environ = {DISABLE_AUTOLOAD_ENV: "1"}
    if source == "flag":
        argv = [setting.flag] if setting.switch else [setting.flag, raw]
        where = f"the command line ({setting.flag})"
    elif source == "env":
        environ[setting.env] = raw
        where = f"environment variable {setting.env}"
    else:
        value = "true" if setting.switch else f'"{raw}"'
        (tmp_path / "serve.toml").write_text(f"{setting.name} = {value}\n")
        argv = ["--config", str(tmp_path / "serve.toml")]
        where = f"config file {tmp_path / 'serve.toml'} (key '{setting.name}')"
    s = load_settings(argv, environ)
    expected: Any = True if setting.switch else setting.parse(raw)
    if setting.repeat:
        expected = setting.combine([expected])
    assert s[setting.name] == expected
    assert s.sources[setting.name] == where
    if setting.engine_field is not None:
        value = s.engine_kwargs()[setting.engine_field]
        assert value == (not expected if setting.invert else expected)


# -- the other commands' engine flags ----------------------------------------------------------

#: Every spelling of an engine flag, with the table's words for it: serve's, and a switch that a
#: command turns over (``--prefix-caching``, where serve's is ``--no-prefix-caching``).
ENGINE_FLAGS = {s.flag: s.help for s in BY_FIELD.values()} | {
    "--" + s.flag.removeprefix("--no-"): s.help.removeprefix("do not ")
    for s in BY_FIELD.values()
    if s.switch
}
#: Named like an engine flag, but another setting: simulate's reads the log serve's writes.
NOT_ENGINE_FLAGS = {("lora-guard simulate", "--step-log")}
#: The commands besides serve that take engine flags (cli: bench and train-adapter).
COMMANDS = {
    "lora-guard": cli.main,
    "lora-guard simulate": simulate.main,
    "bench.engine": bench_engine.main,
    "bench.virtual_time": virtual_time.main,
}


class _Built(Exception):
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self.parser = parser


def _parser_of(main: Callable[[list[str]], int], monkeypatch: pytest.MonkeyPatch) -> Any:
    """The parser ``main`` builds, taken at its ``parse_args`` (so nothing else runs)."""

    def stop(self: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> None:
        raise _Built(self)

    with monkeypatch.context() as patch:
        patch.setattr(argparse.ArgumentParser, "parse_args", stop)
        with pytest.raises(_Built) as built:
            main([])
    return built.value.parser


def _hand_declared(parser: argparse.ArgumentParser) -> tuple[list[str], list[str]]:
    """The engine flags of ``parser`` and its sub-commands' (``prog flag``): those with the
    table's words (from ``add_engine_flags``), and those declared by hand."""
    shared, by_hand = [], []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                more = _hand_declared(sub)
                shared, by_hand = shared + more[0], by_hand + more[1]
        for option in action.option_strings:
            if option not in ENGINE_FLAGS or (parser.prog, option) in NOT_ENGINE_FLAGS:
                continue
            words = ENGINE_FLAGS[option].replace("%", "%%")
            from_table = (action.help or "").startswith(words)
            (shared if from_table else by_hand).append(f"{parser.prog} {option}")
    return shared, by_hand


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_the_other_commands_take_the_engine_flags_from_the_table(
    command: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    shared, by_hand = _hand_declared(_parser_of(COMMANDS[command], monkeypatch))
    assert shared, f"{command}: no engine flag found; is its parser still built by main?"
    assert not by_hand, f"declared by hand: {by_hand}; add them with config.add_engine_flags"


def test_a_hand_declared_engine_flag_is_caught() -> None:
    parser = argparse.ArgumentParser(prog="cmd")
    add_engine_flags(parser, ["model"])
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--prefix-caching", action="store_true", help="reuse the KV")
    assert _hand_declared(parser) == (["cmd --model"], ["cmd --dtype", "cmd --prefix-caching"])


def test_add_engine_flags_reads_values_as_serve_does_with_the_command_s_defaults() -> None:
    parser = argparse.ArgumentParser(prog="cmd")
    add_engine_flags(
        parser,
        ["model", "dtype", "cache_memory", "enable_prefix_caching", "max_model_len"],
        defaults={"dtype": "float32", "enable_prefix_caching": False},
        shown={"cache_memory": "64MiB"},
    )
    args = parser.parse_args([])
    assert vars(args) == {
        "model": None,
        "dtype": "float32",
        "cache_memory": None,
        "prefix_caching": False,
        "max_total_tokens": None,
    }
    args = parser.parse_args(
        [
            "--model",
            "m",
            "--dtype",
            "bf16",
            "--cache-memory",
            "2GiB",
            "--prefix-caching",
            "--max-total-tokens",
            "64",
        ]
    )
    assert vars(args) == {
        "model": "m",
        "dtype": "bfloat16",
        "cache_memory": 2 * 2**30,
        "prefix_caching": True,
        "max_total_tokens": 64,
    }
    helps = {a.dest: a.help for a in parser._actions}
    assert helps["dtype"] == f"{BY_FIELD['dtype'].help} (default: float32)"
    assert helps["cache_memory"] == f"{BY_FIELD['cache_memory'].help} (default: 64MiB)"
    assert helps["model"] == f"{BY_FIELD['model'].help} (default: {BY_FIELD['model'].default_text})"
    with pytest.raises(ValueError, match="max_loras"):
        add_engine_flags(parser, ["dtype"], defaults={"max_loras": 1})


@pytest.mark.parametrize(
    ("argv", "error"),
    [
        (["--dtype", "int8"], "argument --dtype: bad value 'int8': expected one of"),
        (["--block-size", "12"], "argument --block-size: bad value '12': must be a power of two"),
        (["--cache-memory", "lots"], "argument --cache-memory: bad value 'lots': cannot read"),
    ],
)
def test_a_bad_engine_flag_is_a_usage_error_that_says_why(
    argv: list[str], error: str, capsys: pytest.CaptureFixture[str]
) -> None:
    parser = argparse.ArgumentParser(prog="cmd")
    add_engine_flags(parser, ["dtype", "block_size", "cache_memory"])
    with pytest.raises(SystemExit):
        parser.parse_args(argv)
    assert error in capsys.readouterr().err
