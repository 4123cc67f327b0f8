"""The settings table and everything made from it agree: each field of ``EngineConfig`` that users
set is a setting of ``lora-guard serve`` (a flag, a variable and a TOML key), an ``LLM`` keyword
with the same default, and a row of the docs; each setting is read from all three sources."""

from __future__ import annotations

import argparse
import inspect
from dataclasses import MISSING, fields
from pathlib import Path
from typing import Any

import pytest

from lora_guard import LLM
from lora_guard.config import (
    DOCS_TABLES,
    SETTINGS,
    Setting,
    build_parser,
    load_settings,
    with_generated_table,
)
from lora_guard.engine.config import EngineConfig, user_fields
from lora_guard.plugins.manager import DISABLE_AUTOLOAD_ENV

DOCS = Path(__file__).parents[1] / "docs"
LLM_OWN = {"adapter_dir", "adapters", "policies", "plugins", "disabled_plugins", "settings"}
BY_FIELD = {s.engine_field: s for s in SETTINGS if s.engine_field is not None}
# Read before the plugins load; test_config.py covers them.
PHASE_ONE = {"config", "policies", "plugin", "disable_plugin"}


def test_every_engine_field_users_set_is_a_setting_with_its_default() -> None:
    internal = {f.name for f in fields(EngineConfig)} - {f.name for f in user_fields()}
    assert internal == {"lora_mode", "static_adapter", "reject_when_busy"}
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
        f"docs/{name} is out of date: python -m lora_guard.config --write-docs docs"
    )


def _sample(setting: Setting) -> str:
    """A value of ``setting`` as text: its default where it has one, else a small one."""
    if setting.switch:
        return "true"
    if setting.default not in (None, (), {}):
        return setting.shown_default()
    return "x=/p" if setting.name == "adapter" else "3"


@pytest.mark.parametrize("source", ["flag", "env", "file"])
@pytest.mark.parametrize("setting", [s for s in SETTINGS if s.name not in PHASE_ONE],
                         ids=lambda s: s.name)  # fmt: skip
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
