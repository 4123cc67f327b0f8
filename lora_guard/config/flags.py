"""The command line of ``lora-guard serve`` and of the commands that take engine flags, built from
the table."""

from __future__ import annotations

import argparse
import textwrap
from collections.abc import Callable, Mapping, Sequence
from dataclasses import MISSING, replace
from typing import Any, NoReturn

# Neither torch nor the engine is imported here: the adapter registry (which loads torch) is where
# an adapter is named or a folder scanned, torch in engine_names. `lora-guard --help`, the other
# settings' checks and the docs' tables start at once.
from lora_guard.config.table import (
    ENV_PREFIX,
    GROUPS,
    PHASE_ONE,
    PROG,
    SETTINGS_BY_NAME,
    Setting,
    SettingsError,
    all_settings,
    engine_setting,
)
from lora_guard.engine.config import user_fields
from lora_guard.engine.values import resolve_device, resolve_dtype
from lora_guard.plugins.manager import (
    Hooks,
)

# -- the parser ------------------------------------------------------------------------------


class _Formatter(argparse.HelpFormatter):
    """Wraps help text without breaking words at hyphens (``hot-set``, ``--max-loras``)."""

    def _split_lines(self, text: str, width: int) -> list[str]:
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        return textwrap.fill(
            " ".join(text.split()),
            width,
            initial_indent=indent,
            subsequent_indent=indent,
            break_on_hyphens=False,
        )


class _Parser(argparse.ArgumentParser):
    """Raises SettingsError instead of printing usage and exiting (``--help`` still exits)."""

    def error(self, message: str) -> NoReturn:
        raise SettingsError(message)


def build_parser(hooks: Hooks | None = None, *, prog: str = PROG) -> argparse.ArgumentParser:
    """The ``lora-guard serve`` parser: the server's flags and the options of the plugins in
    ``hooks``. Every flag defaults to "not given" (absent from the namespace), so that the
    environment and the file can fill in; ``--help`` shows the real default and the variable.
    Errors raise ``SettingsError``."""
    parser = _Parser(
        prog=prog,
        description="Serve many LoRA adapters on one base model, with guardrails. Every flag is "
        f"also read from the environment variable {ENV_PREFIX}<FLAG_IN_CAPS> (lists "
        "comma-separated; switches 1/0, true/false) and from the TOML file of --config, with "
        "keys named like the flags (max_loras or max-loras). Flag > environment > file > "
        "default.",
        allow_abbrev=False,
        argument_default=argparse.SUPPRESS,
        formatter_class=_Formatter,
    )
    add_arguments(parser, hooks)
    return parser


def add_arguments(parser: argparse.ArgumentParser, hooks: Hooks | None) -> None:
    """Add the flags of ``build_parser`` to ``parser`` (e.g. a ``serve`` sub-parser)."""
    settings = all_settings(hooks)
    groups: dict[str, Any] = {}
    for key, title in GROUPS.items():
        members = [s for s in settings.values() if s.group == key]
        if members:
            groups[key] = parser.add_argument_group(title)
    for setting in settings.values():
        _add_argument(groups[setting.group], setting)


def _add_argument(group: Any, setting: Setting) -> None:
    extra = []
    if setting.repeat:
        extra.append("repeatable; the variable takes a comma list")
    if setting.default is not None or "default" not in setting.help:  # else the help says it
        extra.append(f"default: {setting.shown_default()}")
    extra.append(f"env {setting.env}")
    help_text = f"{setting.help} ({'; '.join(extra)})".replace("%", "%%")
    kwargs: dict[str, Any] = {"dest": setting.name, "help": help_text, "default": argparse.SUPPRESS}
    if setting.switch:
        kwargs["action"] = "store_true"
    else:
        kwargs["action"] = "append" if setting.repeat else "store"
        kwargs["metavar"] = setting.metavar or setting.name.upper()
    group.add_argument(setting.flag, **kwargs)


def add_engine_flags(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    names: Sequence[str],
    *,
    defaults: Mapping[str, Any] | None = None,
    shown: Mapping[str, str] | None = None,
) -> None:
    """Add the flags of the ``EngineConfig`` fields ``names`` (``"dtype"``, ``"max_loras"``) to
    ``parser``, a command's own, as ``lora-guard serve`` has them: the flag, its help and its
    check from the settings table. The value is checked when parsed (``--dtype bf16`` is
    ``"bfloat16"``, ``--cache-memory 2GB`` is bytes, ``--model`` a string); a bad one is a usage
    error. The flag's ``dest`` is its name (``kv_cache_memory``); no environment variable or
    file is read.

    ``defaults`` sets this command's default of a field, as a value of the field (text is checked
    like a flag's); the help then shows it, or ``shown[name]``, the default in words (for a None
    that the command fills in itself). A bool field is a switch that turns its default over:
    ``--no-prefix-caching``, or ``--prefix-caching`` where ``defaults`` turns it off."""
    fields_by_name = {f.name: f for f in user_fields()}
    defaults, shown = dict(defaults or {}), dict(shown or {})
    unknown = sorted(set(names) - set(fields_by_name))
    stray = sorted({*defaults, *shown} - set(names))
    if unknown or stray:
        raise ValueError(
            f"not EngineConfig fields users set: {unknown}; a default for a flag not added: {stray}"
        )
    for name in names:
        setting = engine_setting(fields_by_name[name], defaults.get(name, MISSING))
        if name in shown:
            setting = replace(setting, default_text=shown[name])
        words = setting.help
        if setting.default is not None or "default" not in words:  # else the help says it
            words += f" (default: {setting.shown_default()})"
        kwargs: dict[str, Any] = {"help": words.replace("%", "%%")}
        if setting.switch:
            parser.add_argument(setting.flag, action="store_true", **kwargs)
        else:
            parser.add_argument(
                setting.flag,
                type=_flag_check(setting),
                default=setting.default,
                metavar=setting.metavar or setting.name.upper(),
                **kwargs,
            )


def _flag_check(setting: Setting) -> Callable[[str], Any]:
    """``setting``'s check as an argparse type: a bad value is a usage error that says why."""

    def check(text: str) -> Any:
        try:
            return setting.parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"bad value {text!r}: {exc}") from None

    check.__name__ = setting.name
    return check


def engine_names(device: str, dtype: str) -> tuple[str, str]:
    """``--device`` and ``--dtype`` with ``auto`` resolved as the engine resolves it (cuda where
    torch sees one; bfloat16 on cuda, else float32), as names: for a command that hands them to
    torch, PEFT or another server, or records them."""
    import torch

    if device == "auto":
        device = str(resolve_device(device))
    if dtype == "auto":
        dtype = str(resolve_dtype(dtype, torch.device(device))).removeprefix("torch.")
    return device, dtype


def phase_one_parser() -> _Parser:
    parser = _Parser(
        prog=PROG, add_help=False, allow_abbrev=False, argument_default=argparse.SUPPRESS
    )
    for name in PHASE_ONE:
        setting = SETTINGS_BY_NAME[name]
        parser.add_argument(setting.flag, dest=name, action="append" if setting.repeat else "store")
    return parser
