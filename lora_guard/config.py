"""Settings of ``lora-guard serve``: flags, environment variables and a TOML file.

Every setting has one underscored name (``max_loras``) and three spellings of it: the flag
``--max-loras``, the environment variable ``LORA_GUARD_MAX_LORAS`` and the key ``max_loras`` (or
``max-loras``) at the top level of the TOML file given by ``--config``. A value is taken from the
first of these that has one: flag, then environment, then file, then the default.

The server's own settings are the table ``SETTINGS``. Plugins declare theirs with
``lora_guard_add_options``; which plugins load depends on ``--policies``, ``--plugin`` and
``--disable-plugin`` (from any of the three sources), so settings are read in two phases: those
three (and ``--config``) first, then the plugins load, then every flag, the server's and the
plugins', is read. ``load_settings`` does both and returns a ``ServeSettings`` holding the
``Hooks`` it built, for the server to reuse.

Other commands that take engine flags (bench, simulate --calibrate, ...) add them with
``add_engine_flags``, from the same table; ``lora_guard.settings_docs`` writes the docs' tables.
"""

from __future__ import annotations

import argparse
import difflib
import functools
import importlib
import os
import re
import sys
import textwrap
from collections.abc import Callable, Mapping, Sequence
from dataclasses import MISSING, Field, dataclass, field, replace
from pathlib import Path
from typing import Any, NoReturn

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10
    import tomli as tomllib  # type: ignore[import-not-found,unused-ignore]

# Neither torch nor the engine is imported here: the adapter registry (which loads torch) is where
# an adapter is named or a folder scanned, torch in engine_names. `lora-guard --help`, the other
# settings' checks and the docs' tables start at once.
from lora_guard.engine.config import (
    ORDERS,
    Order,
    at_least,
    describe,
    resolve_device,
    resolve_dtype,
    text,
    user_fields,
)
from lora_guard.plugins.manager import (
    ALWAYS_ON_PLUGINS,
    DEFAULT_POLICIES,
    DISABLE_AUTOLOAD_ENV,
    POLICY_PLUGINS,
    Hooks,
    PluginError,
    make_plugin_manager,
    parse_policies,
)
from lora_guard.plugins.options import Option, OptionRegistry

ENV_PREFIX = "LORA_GUARD_"
#: ``LORA_GUARD_*`` variables with a meaning of their own: never read as settings, never an error.
# LORA_GUARD_VLLM_DIR: the folder of lora_guard.vllm.channel, read by vLLM's processes
RESERVED_ENV = frozenset({"LORA_GUARD_HOME", DISABLE_AUTOLOAD_ENV, "LORA_GUARD_VLLM_DIR"})
PROG = "lora-guard serve"

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})


class SettingsError(ValueError):
    """A setting of ``lora-guard serve`` is unknown, malformed or out of range."""


# -- parsers: one string in, one value out; ValueError says what is wrong ----------------------
# (the engine's fields bring their own: ``EngineConfig`` checks values with the same ones)


def parse_bool(text: str) -> bool:
    """``1/true/yes/on`` or ``0/false/no/off`` (any case)."""
    word = text.strip().lower()
    if word in _TRUE:
        return True
    if word in _FALSE:
        return False
    raise ValueError("expected true or false (1/0, yes/no, on/off)")


def _path(value: str) -> Path:
    return Path(text(value))


def _port(value: str) -> int:
    port = at_least(0)(value)
    if port > 65535:
        raise ValueError("a port is at most 65535")
    return port


def _policies(text: str) -> tuple[str, ...]:
    try:
        chosen = parse_policies(text)
    except PluginError as exc:
        raise ValueError(str(exc)) from None
    if not chosen:
        raise ValueError("name at least one policy")
    return chosen


def _adapter(text: str) -> tuple[str, Path]:
    name, sep, path = text.partition("=")
    name, path = name.strip(), path.strip()
    if not sep or not name or not path:
        raise ValueError("expected NAME=PATH")
    check_adapter_name(name)
    return name, Path(path)


def check_adapter_name(name: str) -> str:
    """``name`` if it is a valid adapter id (letters, digits, ``-``, ``_``, ``.``), else
    ValueError."""
    from lora_guard.engine.lora.registry import valid_adapter_id

    if not valid_adapter_id(name):
        raise ValueError(
            f"adapter name {name!r} may hold only letters, digits, '-', '_' and '.' "
            "(and not only dots)"
        )
    return name


def _adapters(items: Sequence[tuple[str, Path]]) -> dict[str, Path]:
    adapters: dict[str, Path] = {}
    for name, path in items:
        if name in adapters:
            raise ValueError(f"adapter {name!r} is given twice")
        adapters[name] = path
    return adapters


def _plugin_spec(spec: str) -> str:
    value = text(spec)
    if not re.fullmatch(r"[A-Za-z_][\w.]*(:[A-Za-z_][\w.]*)?", value):
        raise ValueError("expected MODULE[:OBJECT], e.g. my_plugins.quota:QuotaPlugin")
    return value


def _tuple(items: Sequence[Any]) -> tuple[Any, ...]:
    return tuple(items)


# -- the table -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Setting:
    """One setting of ``lora-guard serve``.

    ``parse`` reads one value from a string (one item, for a setting that repeats); ``combine``
    turns the items of a repeated setting into its value. A ``switch`` is a flag without a value
    (``--no-prefix-caching``); its environment variable and file key take true or false.
    ``engine_field`` is the ``EngineConfig`` field it feeds (``invert``: with the opposite value).
    """

    name: str
    parse: Callable[[str], Any]
    default: Any
    help: str
    repeat: bool = False
    switch: bool = False
    metavar: str | None = None
    default_text: str | None = None
    group: str = "server"
    combine: Callable[[Sequence[Any]], Any] = _tuple
    engine_field: str | None = None
    invert: bool = False

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.name.upper()

    def shown_default(self) -> str:
        if self.default_text is not None:
            return self.default_text
        if self.switch:
            return "off"
        if isinstance(self.default, tuple | list):
            return ",".join(str(v) for v in self.default) or "none"
        return "none" if self.default is None else str(self.default)


_GROUPS = {
    "model": "model and adapters",
    "server": "HTTP server",
    "engine": "engine",
    "plugins": "policies and plugins",
    "plugin": "plugin settings (declared by the loaded plugins)",
}
#: The setting's name of each engine field (``max_model_len`` is ``max_total_tokens``).
_ENGINE_NAMES = {f.name: f.metadata["flag"] or f.name for f in user_fields()}


def _engine_flag(field_name: str) -> str:
    return "--" + _ENGINE_NAMES[field_name].replace("_", "-")


def _engine_setting(f: Field[Any], default: Any = MISSING) -> Setting:
    """The setting of a field of ``EngineConfig``, at the field's default unless ``default`` is
    given (another command's: then the table's default in words is not shown). A bool field is a
    switch that turns it over: ``--no-prefix-caching`` where it is on, ``--prefix-caching`` where
    a command has it off."""
    meta = f.metadata
    words = describe(meta["help"], _engine_flag)
    shown = describe(meta["shown"], _engine_flag) if meta["shown"] else None
    common: dict[str, Any] = {"group": meta["group"], "engine_field": f.name}
    if default is MISSING:
        default = f.default
    elif default != f.default:
        shown = None
    if isinstance(f.default, bool):
        name = _ENGINE_NAMES[f.name] if default else _ENGINE_NAMES[f.name].removeprefix("no_")
        return Setting(
            name,
            parse_bool,
            False,
            "do not " + words if default else words,
            switch=True,
            invert=bool(default),
            **common,
        )
    default = None if default is MISSING else default
    return Setting(
        _ENGINE_NAMES[f.name],
        meta["check"],
        default,
        words,
        metavar=meta["metavar"],
        default_text=shown,
        **common,
    )


# one row a line, as a table reads (fmt: skip)
_ROWS: tuple[Setting, ...] = (
    Setting("config", _path, None,
            "TOML file of settings, keys as the setting names (max_loras or max-loras); flags and "
            "environment variables override it", metavar="FILE", group="plugins"),
    Setting("adapter_dir", _path, (), "folder whose subfolders are PEFT adapters, id = folder "
            "name; a later folder's adapter replaces an earlier one of the same id", repeat=True,
            metavar="DIR", group="model"),
    Setting("adapter", _adapter, {}, "one more adapter, id NAME (letters, digits, - _ ., not "
            "only dots) at PATH; replaces one of the same id from --adapter-dir; the same NAME "
            "twice is an error", repeat=True, metavar="NAME=PATH", default_text="none",
            combine=_adapters, group="model"),
    Setting("host", text, "127.0.0.1", "address to listen on"),
    Setting("port", _port, 8080, "port to listen on (0: any free port)"),
    Setting("max_concurrent_requests", at_least(1), 128, "requests in flight at once; more are "
            "refused with 429", metavar="N"),
    Setting("max_input_tokens", at_least(1), None, "longest prompt accepted, in tokens; less "
            "than --max-total-tokens", metavar="N", default_text="max total tokens - 1"),
    Setting("max_stop_sequences", at_least(0), 4, "most stop sequences per request",
            metavar="N"),
    Setting("api_key_file", _path, None, "TOML file of API keys ([keys.NAME] with key or sha256, "
            "tenant, adapters, admin); without it the tenant comes from X-Tenant-Id, else "
            "X-Gateway-Inference-Fairness-Id",
            metavar="FILE"),
    Setting("policies", _policies, DEFAULT_POLICIES, "comma list of hot-set, cold-budget, "
            "kv-namespace, or one baseline: lru, fifo, drain, time-slice, s3-fifo, w-tinylfu, "
            "on-demand, static (which needs --static-adapter)", metavar="LIST",
            group="plugins"),
    Setting("plugin", _plugin_spec, (), "load this plugin too", repeat=True,
            metavar="MODULE[:OBJECT]", group="plugins"),
    Setting("disable_plugin", text, (), "do not load the plugin of this name (a built-in such "
            "as hot-set or metrics, or an entry point)", repeat=True, metavar="NAME",
            group="plugins"),
)  # fmt: skip
_ENGINE_SETTINGS = {f.name: _engine_setting(f) for f in user_fields()}
#: Every server setting: the engine's fields and the server's own rows, in ``--help`` order.
SETTINGS: tuple[Setting, ...] = tuple(
    s for group in _GROUPS for s in (*_ENGINE_SETTINGS.values(), *_ROWS) if s.group == group
)
SETTINGS_BY_NAME: dict[str, Setting] = {s.name: s for s in SETTINGS}
# Read before the plugins load: they decide which plugin settings exist.
_PHASE_ONE = ("config", "policies", "plugin", "disable_plugin")
#: Settings the TOML file cannot hold (the docs' table says so too).
NOT_IN_FILE = frozenset({"config"})
_RESERVED_FLAGS = frozenset({"help"})


def _plain_int(text: str) -> int:
    try:
        return int(text.strip())
    except ValueError:
        raise ValueError("expected an integer") from None


def _plain_float(text: str) -> float:
    try:
        return float(text.strip())
    except ValueError:
        raise ValueError("expected a number") from None


_PLAIN_TYPES: dict[Any, Callable[[str], Any]] = {
    bool: parse_bool,
    int: _plain_int,
    float: _plain_float,
}


def plugin_setting(option: Option) -> Setting:
    """The setting of a plugin's option: flag ``--<name>``, variable ``LORA_GUARD_<NAME>``."""
    parse = _PLAIN_TYPES.get(option.type, option.type)
    return Setting(option.name, parse, option.default, option.help, metavar="VALUE", group="plugin")


def all_settings(hooks: Hooks | None) -> dict[str, Setting]:
    """The server's settings and the options of the plugins in ``hooks``; a plugin option named
    like a server setting is the server setting (added once)."""
    settings = dict(SETTINGS_BY_NAME)
    if hooks is not None:
        for option in hooks.options.options.values():
            if option.name not in settings and option.name not in _RESERVED_FLAGS:
                settings[option.name] = plugin_setting(option)
    return settings


# -- the result ------------------------------------------------------------------------------


#: Left to the engine, which resolves them (the demo model, auto device and dtype): plugins read
#: the resolved values from the engine's config.
_ENGINE_RESOLVES = frozenset({"model", "device", "dtype", "lora_dtype"})


@dataclass(frozen=True)
class ServeSettings:
    """Every setting of ``lora-guard serve``, resolved: ``values`` by setting name, also read as
    attributes (``settings.max_loras``). Plugin options are in ``options``; ``settings[name]``
    reads either kind. ``sources[name]`` says where each value came from."""

    values: Mapping[str, Any]
    hooks: Hooks = field(repr=False, compare=False)
    options: Mapping[str, Any] = field(default_factory=dict)
    sources: Mapping[str, str] = field(default_factory=dict, repr=False)

    def __getattr__(self, name: str) -> Any:
        if name in SETTINGS_BY_NAME:
            return self.values[name]
        raise AttributeError(name)

    def __getitem__(self, name: str) -> Any:
        key = name.replace("-", "_")
        if key in SETTINGS_BY_NAME:
            return self.values[key]
        if key in self.options:
            return self.options[key]
        raise KeyError(name)

    def engine_kwargs(self) -> dict[str, Any]:
        """Arguments of ``lora_guard.LLM`` (and of ``EngineConfig``, plus ``adapter_dir`` and
        ``adapters``): each engine field from its setting.

        ``model`` is None when not given: the caller substitutes the demo model. The first
        ``--adapter-dir`` is ``adapter_dir``; the adapters of any further ones are listed in
        ``adapters`` (a later folder wins), then ``--adapter`` entries (which win over all).
        """
        adapters: dict[str, Path] = {}
        for folder in self.adapter_dir[1:]:
            adapters.update(scan_adapter_dir(folder))
        adapters.update(self.adapter)
        kwargs = {
            name: not self.values[s.name] if s.invert else self.values[s.name]
            for name, s in _ENGINE_SETTINGS.items()
        }
        return {
            **kwargs,
            "adapter_dir": self.adapter_dir[0] if self.adapter_dir else None,
            "adapters": adapters,
        }

    def plugin_settings(self) -> dict[str, Any]:
        """The dict for ``Hooks.configure`` (``LLM(settings=...)``): every setting by its name,
        but those the engine resolves (``model``, ``device``, ``dtype``, ``lora_dtype``), and each
        plugin option."""
        values = {k: v for k, v in self.values.items() if k not in _ENGINE_RESOLVES}
        return {**values, **self.options}

    def summary(self) -> list[str]:
        """``name = value  (source)`` per setting, for a start-up log."""
        lines = []
        for name in [*SETTINGS_BY_NAME, *self.options]:
            lines.append(f"{name} = {self[name]!r}  ({self.sources.get(name, 'the default')})")
        return lines


def scan_adapter_dir(folder: Path) -> dict[str, Path]:
    """``{id: path}`` of the adapters in ``folder`` (the registry's scan: valid ids only, a link
    leading outside ``folder`` left out)."""
    from lora_guard.engine.lora.registry import scan_adapter_dir as registry_scan

    try:
        return dict(registry_scan(folder.expanduser()))
    except OSError as exc:
        raise SettingsError(f"--adapter-dir {folder}: cannot list it: {exc.strerror}") from None


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
    for key, title in _GROUPS.items():
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
        setting = _engine_setting(fields_by_name[name], defaults.get(name, MISSING))
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


def _phase_one_parser() -> _Parser:
    parser = _Parser(
        prog=PROG, add_help=False, allow_abbrev=False, argument_default=argparse.SUPPRESS
    )
    for name in _PHASE_ONE:
        setting = SETTINGS_BY_NAME[name]
        parser.add_argument(setting.flag, dest=name, action="append" if setting.repeat else "store")
    return parser


# -- resolution ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _File:
    path: Path
    values: dict[str, tuple[str, Any]]  # name -> (key as written, value)


def _read_file(path: Path) -> _File:
    try:
        with path.expanduser().open("rb") as f:
            data = tomllib.load(f)
    except OSError as exc:
        raise SettingsError(f"cannot read config file {path}: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise SettingsError(f"config file {path} is not valid TOML: {exc}") from None
    values: dict[str, tuple[str, Any]] = {}
    for key, value in data.items():
        name = key.replace("-", "_")
        if name in values:
            raise SettingsError(
                f"config file {path}: {values[name][0]!r} and {key!r} are the same setting"
            )
        if name in NOT_IN_FILE:
            raise SettingsError(f"config file {path}: key {key!r} cannot be set in a config file")
        values[name] = (key, value)
    return _File(path, values)


def _env_value(setting: Setting, environ: Mapping[str, str]) -> str | None:
    raw = environ.get(setting.env)
    return raw if raw is not None and raw.strip() else None  # empty = unset


def _file_items(setting: Setting, value: Any) -> list[str] | str:
    """A TOML value as the strings a flag would give: a list for a repeated setting."""
    if setting.repeat:
        if isinstance(value, dict) and setting.name == "adapter":
            items = []
            for name, path in value.items():
                if "=" in name:
                    check_adapter_name(name)
                items.append(f"{name}={_scalar(path)}")
            return items
        if isinstance(value, list):
            return [_scalar(v) for v in value]
        return [_scalar(value)]
    if isinstance(value, list):
        return ",".join(_scalar(v) for v in value)
    return _scalar(value)


def _scalar(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict | list):
        raise ValueError(f"expected a single value, not {type(value).__name__}")
    return str(value)


def _convert(setting: Setting, raw: Any) -> Any:
    """``raw`` (a string, a list of strings for a repeated setting, True for a given switch)."""
    if setting.switch and raw is True:
        return True
    if setting.repeat:
        items = raw if isinstance(raw, list) else [s for s in raw.split(",") if s.strip()]
        return setting.combine([setting.parse(item) for item in items])
    return setting.parse(raw)


def _resolve(
    setting: Setting,
    given: Mapping[str, Any],
    environ: Mapping[str, str],
    file: _File | None,
) -> tuple[Any, str]:
    """The value of ``setting`` and where it came from: flag > environment > file > default."""
    where: str
    raw: Any
    if setting.name in given:
        raw, where = given[setting.name], f"the command line ({setting.flag})"
    elif (env := _env_value(setting, environ)) is not None:
        raw, where = env, f"environment variable {setting.env}"
    elif file is not None and setting.name in file.values:
        key, value = file.values[setting.name]
        where = f"config file {file.path} (key {key!r})"
        try:
            raw = _file_items(setting, value)
        except ValueError as exc:
            raise SettingsError(
                f"{setting.flag}: bad value {value!r} from {where}: {exc}"
            ) from None
    else:
        return setting.default, "the default"
    try:
        return _convert(setting, raw), where
    except Exception as exc:  # a plugin's type may raise anything
        shown = raw if not isinstance(raw, list) or len(raw) != 1 else raw[0]
        reason = str(exc) or type(exc).__name__
        raise SettingsError(f"{setting.flag}: bad value {shown!r} from {where}: {reason}") from None


@functools.cache
def builtin_option_owners() -> dict[str, str]:
    """``{option name: built-in plugin name}`` over every built-in, loaded or not (for hints)."""
    owners: dict[str, str] = {}
    for name, target in {**POLICY_PLUGINS, **ALWAYS_ON_PLUGINS}.items():
        module_name, _, attr = target.partition(":")
        try:
            obj = getattr(importlib.import_module(module_name), attr)
            plugin = obj() if isinstance(obj, type) else obj
            registry = OptionRegistry()
            add = getattr(plugin, "lora_guard_add_options", None)
            if add is not None:
                add(options=registry)
        except Exception:
            continue
        for option in registry.options:
            owners.setdefault(option, name)
    return owners


def _hint(
    name: str,
    settings: Mapping[str, Setting],
    policies: Sequence[str],
    spell: Callable[[Setting], str],
) -> str:
    """Why ``name`` is unknown: a built-in plugin's option while it is not loaded, or a typo."""
    owner = builtin_option_owners().get(name)
    if owner is not None:
        return (
            f" (a setting of plugin {owner!r}, which is not loaded; policies: {','.join(policies)})"
        )
    close = difflib.get_close_matches(name, list(settings), n=1)
    return f" (did you mean {spell(settings[close[0]])}?)" if close else ""


def _check_unknown(
    argv_extra: Sequence[str],
    environ: Mapping[str, str],
    file: _File | None,
    settings: Mapping[str, Setting],
    policies: Sequence[str],
) -> None:
    problems = []
    for arg in argv_extra:
        if arg.startswith("--"):
            flag = arg.split("=", 1)[0]
            name = flag[2:].replace("-", "_")
            hint = _hint(name, settings, policies, lambda s: s.flag)
            problems.append(f"unknown flag {flag}{hint}")
    if argv_extra and not problems:
        problems.append(f"unexpected argument {argv_extra[0]!r} (serve takes only flags)")
    envs = {s.env for s in settings.values()}
    for key in sorted(environ):
        if (
            key.startswith(ENV_PREFIX)
            and key not in RESERVED_ENV
            and key not in envs
            and environ[key].strip()
        ):
            name = key[len(ENV_PREFIX) :].lower()
            hint = _hint(name, settings, policies, lambda s: s.env)
            problems.append(f"environment variable {key} is not a setting{hint}")
    if file is not None:
        for name, (key, _value) in file.values.items():
            if name not in settings:
                hint = _hint(name, settings, policies, lambda s: repr(s.name))
                problems.append(f"config file {file.path}: unknown key {key!r}{hint}")
    if problems:
        raise SettingsError("; ".join(problems))


class _AutoloadEnv:
    """Make ``os.environ`` agree with ``environ`` on ``LORA_GUARD_DISABLE_PLUGIN_AUTOLOAD`` while
    the plugin manager is built (it reads ``os.environ``)."""

    def __init__(self, environ: Mapping[str, str]) -> None:
        self.wanted = environ.get(DISABLE_AUTOLOAD_ENV)
        self.saved = os.environ.get(DISABLE_AUTOLOAD_ENV)
        self.change = environ is not os.environ and self.wanted != self.saved

    def __enter__(self) -> None:
        if self.change:
            _set_env(DISABLE_AUTOLOAD_ENV, self.wanted)

    def __exit__(self, *exc: object) -> None:
        if self.change:
            _set_env(DISABLE_AUTOLOAD_ENV, self.saved)


def _set_env(key: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(key, None)
    else:
        os.environ[key] = value


def load_settings(argv: Sequence[str], environ: Mapping[str, str] = os.environ) -> ServeSettings:
    """Read the settings of ``lora-guard serve`` from ``argv`` (without the command name),
    ``environ`` and the ``--config`` file; load the plugins they choose.

    Raises ``SettingsError`` naming the setting and its source for anything unknown or malformed.
    ``--help`` prints the help and raises ``SystemExit(0)``, as argparse does.
    """
    argv = list(argv)
    # Phase one: the settings that decide which plugins load, hence which settings exist.
    early, _rest = _phase_one_parser().parse_known_args(argv)
    given = vars(early)
    config_path, config_source = _resolve(SETTINGS_BY_NAME["config"], given, environ, None)
    file = _read_file(config_path) if config_path is not None else None
    values: dict[str, Any] = {"config": config_path}
    sources: dict[str, str] = {"config": config_source}
    for name in _PHASE_ONE[1:]:
        values[name], sources[name] = _resolve(SETTINGS_BY_NAME[name], given, environ, file)
    try:
        with _AutoloadEnv(environ):
            hooks = Hooks(
                make_plugin_manager(values["policies"], values["plugin"], values["disable_plugin"])
            )
    except PluginError as exc:
        where = {sources[n] for n in ("plugin", "disable_plugin") if sources[n] != "the default"}
        raise SettingsError(
            f"{exc}" + (f" (plugins from {', '.join(sorted(where))})" if where else "")
        ) from None

    # Phase two: every flag, the plugins' included.
    settings = all_settings(hooks)
    namespace, extra = build_parser(hooks).parse_known_args(argv)
    _check_unknown(extra, environ, file, settings, values["policies"])
    flags = vars(namespace)
    options: dict[str, Any] = {}
    for name, setting in settings.items():
        if name in values:
            continue
        value, sources[name] = _resolve(setting, flags, environ, file)
        if name in SETTINGS_BY_NAME:
            values[name] = value
        else:
            options[name] = value
    _cross_check(values, options, sources)
    return ServeSettings(values, hooks, options, sources)


#: The server's own rule between settings, checked again against the model's length at start.
INPUT_BELOW_TOTAL = Order("max_input_tokens", "max_total_tokens", strict=True)


def _cross_check(
    values: dict[str, Any], options: Mapping[str, Any], sources: dict[str, str]
) -> None:
    for order in (*ORDERS, INPUT_BELOW_TOTAL):
        if not order.settle(values, lambda name: sources[name] == "the default"):
            names = (order.low, order.high) if order.strict else (order.high, order.low)
            where = "; ".join(f"{SETTINGS_BY_NAME[n].flag} from {sources[n]}" for n in names)
            raise SettingsError(f"{order.message(lambda n: SETTINGS_BY_NAME[n].flag)} ({where})")
    if "static" in values["policies"] and not options.get("static_adapter"):
        raise SettingsError(
            "--policies static needs the adapter to serve: --static-adapter ID "
            f"(or {ENV_PREFIX}STATIC_ADAPTER, or static_adapter in the config file)"
        )
