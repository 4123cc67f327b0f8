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

from lora_guard.config.flags import add_engine_flags, build_parser, engine_names
from lora_guard.config.resolve import (
    INPUT_BELOW_TOTAL,
    ServeSettings,
    load_settings,
    scan_adapter_dir,
)
from lora_guard.config.table import (
    NOT_IN_FILE,
    SETTINGS,
    SETTINGS_BY_NAME,
    Setting,
    SettingsError,
)

__all__ = [
    "INPUT_BELOW_TOTAL",
    "NOT_IN_FILE",
    "SETTINGS",
    "SETTINGS_BY_NAME",
    "ServeSettings",
    "Setting",
    "SettingsError",
    "add_engine_flags",
    "build_parser",
    "engine_names",
    "load_settings",
    "scan_adapter_dir",
]
