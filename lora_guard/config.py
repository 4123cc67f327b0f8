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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10
    import tomli as tomllib  # type: ignore[import-not-found,unused-ignore]

from lora_guard.engine.lora.registry import scan_adapter_dir as registry_scan
from lora_guard.engine.lora.registry import valid_adapter_id
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
RESERVED_ENV = frozenset({"LORA_GUARD_HOME", DISABLE_AUTOLOAD_ENV})
PROG = "lora-guard serve"

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})
_DEVICE = re.compile(r"auto|cpu|mps|cuda(:\d+)?")
_DTYPES = {
    "auto": "auto",
    "float32": "float32", "fp32": "float32", "float": "float32",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float16": "float16", "fp16": "float16", "half": "float16",
}  # fmt: skip


class SettingsError(ValueError):
    """A setting of ``lora-guard serve`` is unknown, malformed or out of range."""


# -- parsers: one string in, one value out; ValueError says what is wrong ----------------------


def parse_bool(text: str) -> bool:
    """``1/true/yes/on`` or ``0/false/no/off`` (any case)."""
    word = text.strip().lower()
    if word in _TRUE:
        return True
    if word in _FALSE:
        return False
    raise ValueError("expected true or false (1/0, yes/no, on/off)")


def _text(text: str) -> str:
    value = text.strip()
    if not value:
        raise ValueError("must not be empty")
    return value


def _path(text: str) -> Path:
    return Path(_text(text))


def _int_at_least(low: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text.strip())
        except ValueError:
            raise ValueError("expected an integer") from None
        if value < low:
            raise ValueError(f"must be at least {low}")
        return value

    parse.__name__ = f"int_at_least_{low}"
    return parse


def _port(text: str) -> int:
    value = _int_at_least(0)(text)
    if value > 65535:
        raise ValueError("a port is at most 65535")
    return value


def _power_of_two(text: str) -> int:
    value = _int_at_least(1)(text)
    if value & (value - 1):
        raise ValueError("must be a power of two")
    return value


def _device(text: str) -> str:
    value = text.strip().lower()
    if not _DEVICE.fullmatch(value):
        raise ValueError("expected auto, cpu, cuda, cuda:N or mps")
    return value


def _dtype(text: str) -> str:
    value = text.strip().lower()
    if value not in _DTYPES:
        raise ValueError("expected auto, float32, bfloat16 or float16")
    return _DTYPES[value]


def _choice(*choices: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        value = text.strip().lower()
        if value not in choices:
            raise ValueError(f"expected one of {', '.join(choices)}")
        return value

    return parse


def _policies(text: str) -> tuple[str, ...]:
    try:
        chosen = parse_policies(text)
    except PluginError as exc:
        raise ValueError(str(exc)) from None
    if not chosen:
        raise ValueError("name at least one policy")
    return chosen


def _memory(text: str) -> int:
    # Plain bytes and plain nonsense are told apart here; sizes with units go to the engine's
    # parse_memory, which imports torch.
    if text.strip().isdigit():
        return _int_at_least(1)(text)
    if not re.fullmatch(r"\s*\d+(\.\d+)?\s*[a-zA-Z]+\s*", text):
        raise ValueError(f"cannot read {text!r} as a memory size (try 512MiB or 2GB)")
    from lora_guard.engine.config import parse_memory  # imports torch: only when asked for

    return parse_memory(text.strip())


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


def _plugin_spec(text: str) -> str:
    value = _text(text)
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

SETTINGS: tuple[Setting, ...] = (
    Setting("config", _path, None,
            "TOML file of settings, keys as the setting names (max_loras or max-loras); flags and "
            "environment variables override it", metavar="FILE", group="plugins"),
    Setting("model", _text, None, "Hugging Face checkpoint folder (config.json, *.safetensors, "
            "tokenizer)", metavar="DIR", default_text="the demo model, prepared if missing",
            group="model"),
    Setting("model_id", _text, None, "name of the base model in /info, /v1/models and the "
            "OpenAI `model` field", metavar="NAME", default_text="from the checkpoint",
            group="model"),
    Setting("adapter_dir", _path, (), "folder whose subfolders are PEFT adapters, id = folder "
            "name; a later folder's adapter replaces an earlier one of the same id", repeat=True,
            metavar="DIR", group="model"),
    Setting("adapter", _adapter, {}, "one more adapter, id NAME (letters, digits, - _ .) at "
            "PATH; replaces one of the same id from --adapter-dir", repeat=True,
            metavar="NAME=PATH", default_text="none", combine=_adapters, group="model"),
    Setting("host", _text, "127.0.0.1", "address to listen on", group="server"),
    Setting("port", _port, 8080, "port to listen on (0: any free port)", group="server"),
    Setting("max_concurrent_requests", _int_at_least(1), 128, "requests in flight at once; "
            "more are refused with 429", metavar="N", group="server"),
    Setting("max_input_tokens", _int_at_least(1), None, "longest prompt accepted, in tokens",
            metavar="N", default_text="max total tokens - 1", group="server"),
    Setting("max_total_tokens", _int_at_least(2), None, "longest prompt + generated tokens of "
            "one request", metavar="N", default_text="the model's context length",
            group="server"),
    Setting("max_stop_sequences", _int_at_least(0), 4, "most stop sequences per request",
            metavar="N", group="server"),
    Setting("api_key_file", _path, None, "TOML file of API keys ([keys.NAME] with key or sha256, "
            "tenant, adapters, admin); without it the tenant comes from X-Tenant-Id",
            metavar="FILE", group="server"),
    Setting("device", _device, "auto", "cpu, cuda, cuda:N or auto (cuda when available)",
            group="engine"),
    Setting("dtype", _dtype, "auto", "float32, bfloat16, float16 or auto (bfloat16 on cuda, "
            "float32 on cpu)", group="engine"),
    Setting("max_loras", _int_at_least(1), 8, "device slots: adapters resident at once",
            metavar="N", group="engine"),
    Setting("max_cpu_loras", _int_at_least(1), 32, "adapters kept in host memory (raised to "
            "--max-loras when left at its default)", metavar="N", group="engine"),
    Setting("max_lora_rank", _int_at_least(1), 64, "largest adapter rank accepted (adapters "
            "take pages for their own rank, never this one)", metavar="N", group="engine"),
    Setting("cache_memory", _memory, None, "size of the one cache pool that KV blocks and "
            "adapter weights share, bytes or e.g. 512MiB, 2GB", metavar="SIZE",
            default_text="--kv-cache-memory, else a quarter of free memory", group="engine"),
    Setting("kv_cache_memory", _memory, None, "the cache pool's size under its former name "
            "(used when --cache-memory is not given)", metavar="SIZE",
            default_text="a quarter of free memory", group="engine"),
    Setting("residency_quantum_ms", _int_at_least(0), 1000, "an adapter that requests still "
            "need stays in the pool at least this long after its load (no thrash)",
            metavar="MS", group="engine"),
    Setting("lora_compute", _choice("loop", "batched"), "loop", "how a step computes the LoRA "
            "updates: loop (per adapter segment) or batched (one gathered batched matmul per "
            "projection)", metavar="MODE", group="engine"),
    Setting("block_size", _power_of_two, 16, "tokens per KV block (a power of two)",
            metavar="N", group="engine"),
    Setting("no_prefix_caching", parse_bool, False, "do not reuse KV blocks of shared prefixes",
            switch=True, group="engine"),
    Setting("max_batch_tokens", _int_at_least(1), 2048, "tokens per engine step (prefill and "
            "decode together)", metavar="N", group="engine"),
    Setting("max_num_seqs", _int_at_least(1), 64, "sequences in the running batch at once",
            metavar="N", group="engine"),
    Setting("policies", _policies, DEFAULT_POLICIES, "comma list of hot-set, cold-budget, "
            "kv-namespace, or one baseline: lru, on-demand, static", metavar="LIST",
            group="plugins"),
    Setting("plugin", _plugin_spec, (), "load this plugin too", repeat=True,
            metavar="MODULE[:OBJECT]", group="plugins"),
    Setting("disable_plugin", _text, (), "do not load the plugin of this name (a built-in or an "
            "entry point)", repeat=True, metavar="NAME", group="plugins"),
)  # fmt: skip
SETTINGS_BY_NAME: dict[str, Setting] = {s.name: s for s in SETTINGS}
# Read before the plugins load: they decide which plugin settings exist.
_PHASE_ONE = ("config", "policies", "plugin", "disable_plugin")
_NOT_IN_FILE = frozenset({"config"})
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
    return Setting(option.name, parse, option.default, option.help, metavar="VALUE",
                   group="plugin")  # fmt: skip


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


@dataclass(frozen=True)
class ServeSettings:
    """Every setting of ``lora-guard serve``, resolved. Plugin options are in ``options``;
    ``settings[name]`` reads either kind. ``sources[name]`` says where each value came from."""

    config: Path | None
    model: str | None
    model_id: str | None
    adapter_dir: tuple[Path, ...]
    adapter: Mapping[str, Path]
    host: str
    port: int
    max_concurrent_requests: int
    max_input_tokens: int | None
    max_total_tokens: int | None
    max_stop_sequences: int
    api_key_file: Path | None
    device: str
    dtype: str
    max_loras: int
    max_cpu_loras: int
    max_lora_rank: int
    cache_memory: int | None
    kv_cache_memory: int | None
    residency_quantum_ms: int
    lora_compute: str
    block_size: int
    no_prefix_caching: bool
    max_batch_tokens: int
    max_num_seqs: int
    policies: tuple[str, ...]
    plugin: tuple[str, ...]
    disable_plugin: tuple[str, ...]
    hooks: Hooks = field(repr=False, compare=False)
    options: Mapping[str, Any] = field(default_factory=dict)
    sources: Mapping[str, str] = field(default_factory=dict, repr=False)

    def __getitem__(self, name: str) -> Any:
        key = name.replace("-", "_")
        if key in SETTINGS_BY_NAME:
            return getattr(self, key)
        if key in self.options:
            return self.options[key]
        raise KeyError(name)

    @property
    def enable_prefix_caching(self) -> bool:
        return not self.no_prefix_caching

    def engine_kwargs(self) -> dict[str, Any]:
        """Arguments of ``lora_guard.LLM`` (and of ``EngineConfig``, plus ``adapter_dir`` and
        ``adapters``).

        ``model`` is None when not given: the caller substitutes the demo model. The first
        ``--adapter-dir`` is ``adapter_dir``; the adapters of any further ones are listed in
        ``adapters`` (a later folder wins), then ``--adapter`` entries (which win over all).
        ``max_model_len`` is ``--max-total-tokens``.
        """
        adapters: dict[str, Path] = {}
        for folder in self.adapter_dir[1:]:
            adapters.update(scan_adapter_dir(folder))
        adapters.update(self.adapter)
        return {
            "model": self.model,
            "model_id": self.model_id,
            "adapter_dir": self.adapter_dir[0] if self.adapter_dir else None,
            "adapters": adapters,
            "max_loras": self.max_loras,
            "max_cpu_loras": self.max_cpu_loras,
            "max_lora_rank": self.max_lora_rank,
            "cache_memory": self.cache_memory,
            "kv_cache_memory": self.kv_cache_memory,
            "residency_quantum_ms": self.residency_quantum_ms,
            "lora_compute": self.lora_compute,
            "block_size": self.block_size,
            "enable_prefix_caching": self.enable_prefix_caching,
            "max_batch_tokens": self.max_batch_tokens,
            "max_num_seqs": self.max_num_seqs,
            "max_model_len": self.max_total_tokens,
            "dtype": self.dtype,
            "device": self.device,
        }

    def plugin_settings(self) -> dict[str, Any]:
        """The dict for ``Hooks.configure`` (``LLM(settings=...)``): every plugin option, plus the
        engine's sizes and the server's limits that plugins may read (``max_loras``,
        ``max_num_seqs``, ...). Device and dtype are left to the engine, which resolves them."""
        values: dict[str, Any] = {
            "model_id": self.model_id,
            "max_loras": self.max_loras,
            "max_cpu_loras": self.max_cpu_loras,
            "max_lora_rank": self.max_lora_rank,
            "cache_memory": self.cache_memory,
            "kv_cache_memory": self.kv_cache_memory,
            "residency_quantum_ms": self.residency_quantum_ms,
            "block_size": self.block_size,
            "enable_prefix_caching": self.enable_prefix_caching,
            "max_batch_tokens": self.max_batch_tokens,
            "max_num_seqs": self.max_num_seqs,
            "max_model_len": self.max_total_tokens,
            "policies": self.policies,
            "max_concurrent_requests": self.max_concurrent_requests,
            "max_input_tokens": self.max_input_tokens,
            "max_total_tokens": self.max_total_tokens,
            "max_stop_sequences": self.max_stop_sequences,
        }
        values.update(self.options)
        return values

    def summary(self) -> list[str]:
        """``name = value  (source)`` per setting, for a start-up log."""
        lines = []
        for name in [*SETTINGS_BY_NAME, *self.options]:
            lines.append(f"{name} = {self[name]!r}  ({self.sources.get(name, 'the default')})")
        return lines


def scan_adapter_dir(folder: Path) -> dict[str, Path]:
    """``{id: path}`` of the adapters in ``folder`` (the registry's scan: valid ids only, a link
    leading outside ``folder`` left out)."""
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
            " ".join(text.split()), width, initial_indent=indent, subsequent_indent=indent,
            break_on_hyphens=False,
        )  # fmt: skip


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
    kwargs: dict[str, Any] = {"dest": setting.name, "help": help_text,
                              "default": argparse.SUPPRESS}  # fmt: skip
    if setting.switch:
        kwargs["action"] = "store_true"
    else:
        kwargs["action"] = "append" if setting.repeat else "store"
        kwargs["metavar"] = setting.metavar or setting.name.upper()
    group.add_argument(setting.flag, **kwargs)


def _phase_one_parser() -> _Parser:
    parser = _Parser(prog=PROG, add_help=False, allow_abbrev=False,
                     argument_default=argparse.SUPPRESS)  # fmt: skip
    for name in _PHASE_ONE:
        setting = SETTINGS_BY_NAME[name]
        parser.add_argument(setting.flag, dest=name,
                            action="append" if setting.repeat else "store")  # fmt: skip
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
        if name in _NOT_IN_FILE:
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
    return ServeSettings(**values, options=options, sources=sources, hooks=hooks)


def _cross_check(
    values: dict[str, Any], options: Mapping[str, Any], sources: dict[str, str]
) -> None:
    def fail(message: str, *names: str) -> NoReturn:
        where = "; ".join(f"{SETTINGS_BY_NAME[n].flag} from {sources[n]}" for n in names)
        raise SettingsError(f"{message} ({where})")

    if values["max_cpu_loras"] < values["max_loras"]:
        if sources["max_cpu_loras"] != "the default":
            fail("--max-cpu-loras must be at least --max-loras", "max_cpu_loras", "max_loras")
        values["max_cpu_loras"] = values["max_loras"]
    if values["max_batch_tokens"] < values["block_size"]:
        fail("--max-batch-tokens must be at least --block-size", "max_batch_tokens", "block_size")
    total, inputs = values["max_total_tokens"], values["max_input_tokens"]
    if total is not None and inputs is not None and inputs >= total:
        fail(
            "--max-input-tokens must be less than --max-total-tokens",
            "max_input_tokens",
            "max_total_tokens",
        )
    if "static" in values["policies"] and not options.get("static_adapter"):
        raise SettingsError(
            "--policies static needs the adapter to serve: --static-adapter ID "
            f"(or {ENV_PREFIX}STATIC_ADAPTER, or static_adapter in the config file)"
        )
