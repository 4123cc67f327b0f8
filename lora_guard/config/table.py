"""The settings of ``lora-guard serve`` as one table (``SETTINGS``): each one's flag, type, default,
check and help, from the engine's fields and the server's own; the parsers that check a value."""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import MISSING, Field, dataclass
from pathlib import Path
from typing import Any

# Neither torch nor the engine is imported here: the adapter registry (which loads torch) is where
# an adapter is named or a folder scanned, torch in engine_names. `lora-guard --help`, the other
# settings' checks and the docs' tables start at once.
from lora_guard.engine.config import describe, user_fields
from lora_guard.engine.values import at_least, text
from lora_guard.plugins.manager import (
    DEFAULT_POLICIES,
    DISABLE_AUTOLOAD_ENV,
    Hooks,
    PluginError,
    parse_policies,
)
from lora_guard.plugins.options import Option

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


GROUPS = {
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


def engine_setting(f: Field[Any], default: Any = MISSING) -> Setting:
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
    Setting("request_log", _path, None, "append one JSON line a generation request: where its "
            "time went (queue, the engine steps that computed it, the engine's time between "
            "them, HTTP), keyed by its X-Request-Id (docs/metrics.md)", metavar="FILE"),
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
ENGINE_SETTINGS = {f.name: engine_setting(f) for f in user_fields()}
#: Every server setting: the engine's fields and the server's own rows, in ``--help`` order.
SETTINGS: tuple[Setting, ...] = tuple(
    s for group in GROUPS for s in (*ENGINE_SETTINGS.values(), *_ROWS) if s.group == group
)
SETTINGS_BY_NAME: dict[str, Setting] = {s.name: s for s in SETTINGS}
# Read before the plugins load: they decide which plugin settings exist.
PHASE_ONE = ("config", "policies", "plugin", "disable_plugin")
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
