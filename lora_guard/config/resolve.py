"""A value for every setting, from flag, environment, file or default (``load_settings``), in two
phases around the plugins' loading; and what it returns (``ServeSettings``)."""

from __future__ import annotations

import difflib
import functools
import importlib
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10
    import tomli as tomllib  # type: ignore[import-not-found,unused-ignore]

# Neither torch nor the engine is imported here: the adapter registry (which loads torch) is where
# an adapter is named or a folder scanned, torch in engine_names. `lora-guard --help`, the other
# settings' checks and the docs' tables start at once.
from lora_guard.config.flags import build_parser, phase_one_parser
from lora_guard.config.table import (
    ENGINE_SETTINGS,
    ENV_PREFIX,
    NOT_IN_FILE,
    PHASE_ONE,
    RESERVED_ENV,
    SETTINGS_BY_NAME,
    Setting,
    SettingsError,
    all_settings,
    check_adapter_name,
)
from lora_guard.engine.config import (
    ORDERS,
    Order,
)
from lora_guard.plugins.manager import (
    ALWAYS_ON_PLUGINS,
    DISABLE_AUTOLOAD_ENV,
    POLICY_PLUGINS,
    Hooks,
    PluginError,
    make_plugin_manager,
)
from lora_guard.plugins.options import OptionRegistry

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
            for name, s in ENGINE_SETTINGS.items()
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
    early, _rest = phase_one_parser().parse_known_args(argv)
    given = vars(early)
    config_path, config_source = _resolve(SETTINGS_BY_NAME["config"], given, environ, None)
    file = _read_file(config_path) if config_path is not None else None
    values: dict[str, Any] = {"config": config_path}
    sources: dict[str, str] = {"config": config_source}
    for name in PHASE_ONE[1:]:
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
