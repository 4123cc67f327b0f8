"""Settings of ``lora-guard serve``: flags, environment, TOML file, plugin options. No model."""

from __future__ import annotations

import itertools
import os
from pathlib import Path
from typing import Any

import pytest

from lora_guard.config import (
    SETTINGS,
    ServeSettings,
    SettingsError,
    build_parser,
    load_settings,
)
from lora_guard.plugins.manager import DISABLE_AUTOLOAD_ENV, Hooks

# The stable flag names of DESIGN.md section 5 ("Config").
# one row a line, as a table reads (fmt: skip)
DESIGN_FLAGS = (
    "--model", "--model-id", "--adapter-dir", "--adapter", "--host", "--port", "--device",
    "--dtype", "--max-loras", "--max-cpu-loras", "--max-lora-rank", "--max-loras-per-batch",
    "--policies", "--hot-set-size", "--pin", "--cold-loads-per-minute", "--low-watermark",
    "--high-watermark", "--kv-cache-memory", "--block-size", "--no-prefix-caching",
    "--kv-namespace-scope", "--max-concurrent-requests", "--max-input-tokens",
    "--max-total-tokens", "--max-batch-tokens", "--api-key-file", "--plugin", "--disable-plugin",
)  # fmt: skip
# Those that are the policies' own options, not the server's.
# one row a line, as a table reads (fmt: skip)
PLUGIN_FLAGS = {
    "--max-loras-per-batch", "--hot-set-size", "--pin", "--cold-loads-per-minute",
    "--low-watermark", "--high-watermark", "--kv-namespace-scope",
}  # fmt: skip

_modules = itertools.count()


def load(argv: list[str] | tuple[str, ...] = (), **env: str) -> ServeSettings:
    """load_settings with only the given LORA_GUARD_* variables (and no entry-point plugins)."""
    return load_settings(list(argv), {DISABLE_AUTOLOAD_ENV: "1", **env})


def toml(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "serve.toml"
    path.write_text(text)
    return path


def test_defaults() -> None:
    s = load()
    for setting in SETTINGS:
        expected = setting.combine(setting.default) if setting.repeat else setting.default
        assert s[setting.name] == expected, setting.name
        assert s.sources[setting.name] == "the default"
    assert s.policies == ("hot-set", "cold-budget", "kv-namespace")
    assert (s.host, s.port, s.max_loras, s.max_num_seqs, s.max_stop_sequences) == (
        "127.0.0.1",
        8080,
        0,
        64,
        4,
    )
    assert s.options["cold_loads_per_minute"] == 6
    assert isinstance(s.hooks, Hooks)
    assert "hot-set" in s.hooks.names()


def test_every_setting_reads_as_an_attribute_and_an_item() -> None:
    s = load(["--max-loras", "4"])
    for setting in SETTINGS:
        assert getattr(s, setting.name) is s[setting.name] is s.values[setting.name]
        assert setting.flag == "--" + setting.name.replace("_", "-")
        assert setting.env == "LORA_GUARD_" + setting.name.upper()
    assert s.max_loras == s["max-loras"] == 4
    with pytest.raises(AttributeError):
        _ = s.cold_loads_per_minute  # a plugin option: s.options or s[...]


def test_every_design_flag_that_is_not_a_plugin_option_is_in_the_table() -> None:
    table = {s.flag for s in SETTINGS}
    assert set(DESIGN_FLAGS) - PLUGIN_FLAGS <= table
    assert not PLUGIN_FLAGS & table
    assert {"--max-stop-sequences", "--max-num-seqs", "--config"} <= table


@pytest.mark.parametrize(
    ("flag", "env", "file", "expected", "source"),
    [
        (None, None, None, 0, "the default"),
        (None, None, "3", 3, "config file"),
        (None, "4", "3", 4, "environment variable LORA_GUARD_MAX_LORAS"),
        ("5", "4", "3", 5, "the command line (--max-loras)"),
        ("5", None, "3", 5, "the command line (--max-loras)"),
        ("5", None, None, 5, "the command line (--max-loras)"),
    ],
)
def test_precedence_of_a_server_setting(
    tmp_path: Path, flag: str | None, env: str | None, file: str | None, expected: int, source: str
) -> None:
    argv: list[str] = []
    environ: dict[str, str] = {}
    if file is not None:
        argv += ["--config", str(toml(tmp_path, f"max_loras = {file}\n"))]
    if env is not None:
        environ["LORA_GUARD_MAX_LORAS"] = env
    if flag is not None:
        argv += ["--max-loras", flag]
    s = load(argv, **environ)
    assert s.max_loras == expected
    assert s.sources["max_loras"].startswith(source)
    assert s.engine_kwargs()["max_loras"] == expected
    assert s.plugin_settings()["max_loras"] == expected


@pytest.mark.parametrize(
    ("flag", "env", "file", "expected"),
    [
        (None, None, None, 6),
        (None, None, "9", 9),
        (None, "10", "9", 10),
        ("12", "10", "9", 12),
        ("12", None, None, 12),
    ],
)
def test_precedence_of_a_plugin_option(
    tmp_path: Path, flag: str | None, env: str | None, file: str | None, expected: int
) -> None:
    argv: list[str] = []
    environ: dict[str, str] = {}
    if file is not None:
        # dash form in the file, config file named by the environment
        environ["LORA_GUARD_CONFIG"] = str(toml(tmp_path, f"cold-loads-per-minute = {file}\n"))
    if env is not None:
        environ["LORA_GUARD_COLD_LOADS_PER_MINUTE"] = env
    if flag is not None:
        argv += ["--cold-loads-per-minute", flag]
    s = load(argv, **environ)
    assert s.options["cold_loads_per_minute"] == expected
    assert s["cold-loads-per-minute"] == expected
    assert s.plugin_settings()["cold_loads_per_minute"] == expected


def test_config_file_with_every_kind_of_value(tmp_path: Path) -> None:
    path = toml(
        tmp_path,
        """
model = "/models/llama"
adapter-dir = ["/a"]
port = 9000
no_prefix_caching = true
kv_cache_memory = 1048576
policies = "hot-set,cold-budget"
pin = ["x", "y"]
low_watermark = 0.5
max_input_tokens = 100
max_total_tokens = 200

[adapter]
sql = "/adapters/sql"
"chat.v2" = "/adapters/chat"
""",
    )
    s = load(["--config", str(path)])
    assert s.config == path
    assert s.model == "/models/llama"
    assert s.adapter_dir == (Path("/a"),)
    assert s.port == 9000
    assert s.no_prefix_caching is True
    assert s.kv_cache_memory == 2**20
    assert s.policies == ("hot-set", "cold-budget")
    assert "kv_namespace_scope" not in s.options  # kv-namespace is not loaded
    assert s.options["pin"] == ("x", "y")
    assert s.options["low_watermark"] == 0.5
    assert s.adapter == {"sql": Path("/adapters/sql"), "chat.v2": Path("/adapters/chat")}
    assert (s.max_input_tokens, s.max_total_tokens) == (100, 200)
    assert s.engine_kwargs()["max_model_len"] == 200


def test_the_file_decides_which_plugins_load(tmp_path: Path) -> None:
    s = load(["--config", str(toml(tmp_path, 'policies = "lru"\nmetrics_window_s = 5\n'))])
    assert s.policies == ("lru",)
    assert "hot_set_size" not in s.options
    assert s.options["metrics_window_s"] == 5.0


def test_unknown_toml_key_is_an_error_naming_it(tmp_path: Path) -> None:
    path = toml(tmp_path, "max_loras = 4\nmax_lorass = 5\n")
    with pytest.raises(SettingsError, match=r"unknown key 'max_lorass'.*did you mean 'max_loras'"):
        load(["--config", str(path)])
    path = toml(tmp_path, 'policies = "lru"\nhot_set_size = 2\n')
    with pytest.raises(SettingsError, match=r"'hot_set_size'.*plugin 'hot-set'.*not loaded"):
        load(["--config", str(path)])


def test_bad_config_files(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match="cannot read config file"):
        load(["--config", str(tmp_path / "missing.toml")])
    with pytest.raises(SettingsError, match="not valid TOML"):
        load(["--config", str(toml(tmp_path, "max_loras = = 4\n"))])
    with pytest.raises(SettingsError, match="'max_loras' and 'max-loras' are the same setting"):
        load(["--config", str(toml(tmp_path, "max_loras = 4\nmax-loras = 5\n"))])
    with pytest.raises(SettingsError, match="cannot be set in a config file"):
        load(["--config", str(toml(tmp_path, 'config = "other.toml"\n'))])


def test_unknown_environment_variables(tmp_path: Path) -> None:
    with pytest.raises(
        SettingsError, match=r"LORA_GUARD_MAX_LORAZ.*did you mean LORA_GUARD_MAX_LORAS"
    ):
        load(LORA_GUARD_MAX_LORAZ="4")
    with pytest.raises(SettingsError, match=r"LORA_GUARD_HOT_SET_SIZE.*not loaded"):
        load(["--policies", "lru"], LORA_GUARD_HOT_SET_SIZE="2")
    # variables with a meaning of their own, and empty ones, are not settings
    s = load(LORA_GUARD_HOME=str(tmp_path), LORA_GUARD_PORT="", LORA_GUARD_WHATEVER=" ")
    assert s.port == 8080
    assert load(LORA_GUARD_CONFIG=str(toml(tmp_path, "port = 1\n"))).port == 1


# one case a line, as a table reads (fmt: skip)
BAD_VALUES = [
    (["--max-loras", "many"], {}, None,
     r"--max-loras: bad value 'many' from the command line \(--max-loras\): expected an int"),
    ([], {"LORA_GUARD_MAX_LORAS": "-1"}, None,
     r"--max-loras: bad value '-1' from environment variable LORA_GUARD_MAX_LORAS: must be at"),
    ([], {}, "max_loras = 2.5",
     r"--max-loras: bad value '2.5' from config file .*serve.toml \(key 'max_loras'\)"),
    ([], {}, "max-loras = [1, 2]", r"--max-loras: bad value .* from config file .*max-loras"),
    (["--port", "70000"], {}, None, r"--port: .*at most 65535"),
    (["--block-size", "12"], {}, None, r"--block-size: .*power of two"),
    (["--device", "tpu"], {}, None, r"--device: bad value 'tpu'"),
    ([], {"LORA_GUARD_DTYPE": "int8"}, None, r"--dtype: .*LORA_GUARD_DTYPE"),
    (["--policies", "lru,hot-set"], {}, None, r"--policies: .*cannot be combined"),
    ([], {"LORA_GUARD_POLICIES": "best"}, None, r"--policies: .*LORA_GUARD_POLICIES.*best"),
    ([], {}, 'kv-cache-memory = "lots"', r"--kv-cache-memory: bad value 'lots' from config"),
    ([], {"LORA_GUARD_NO_PREFIX_CACHING": "maybe"}, None,
     r"--no-prefix-caching: .*LORA_GUARD_NO_PREFIX_CACHING: expected true or false"),
    (["--cold-loads-per-minute", "1.5"], {}, None,
     r"--cold-loads-per-minute: bad value '1.5' from the command line"),
    ([], {"LORA_GUARD_LOW_WATERMARK": "high"}, None,
     r"--low-watermark: .*LORA_GUARD_LOW_WATERMARK: expected a number"),
    (["--plugin", "not a module"], {}, None, r"--plugin: .*MODULE\[:OBJECT\]"),
    (["--max-loras"], {}, None, r"--max-loras: expected one argument"),
]  # fmt: skip


@pytest.mark.parametrize(("argv", "env", "file", "match"), BAD_VALUES)
def test_bad_values_name_the_setting_and_the_source(
    tmp_path: Path, argv: list[str], env: dict[str, str], file: str | None, match: str
) -> None:
    if file is not None:
        argv = [*argv, "--config", str(toml(tmp_path, file + "\n"))]
    with pytest.raises(SettingsError, match=match):
        load(argv, **env)


def test_cross_checks() -> None:
    with pytest.raises(SettingsError, match=r"--max-input-tokens must be less.*LORA_GUARD_MAX_IN"):
        load(["--max-total-tokens", "100"], LORA_GUARD_MAX_INPUT_TOKENS="100")
    with pytest.raises(SettingsError, match="--max-batch-tokens must be at least --block-size"):
        load(["--max-batch-tokens", "16", "--block-size", "32"])
    with pytest.raises(SettingsError, match="--max-cpu-loras must be at least --max-loras"):
        load(["--max-loras", "16", "--max-cpu-loras", "8"])
    # left at its default, max_cpu_loras follows max_loras up
    s = load(["--max-loras", "64"])
    assert s.max_cpu_loras == 64 and s.engine_kwargs()["max_cpu_loras"] == 64
    with pytest.raises(SettingsError, match=r"--policies static needs .*--static-adapter"):
        load(["--policies", "static"])
    s = load(["--policies", "static", "--static-adapter", "sql"])
    assert s.plugin_settings()["static_adapter"] == "sql"


def test_adapter_flags_make_a_dict() -> None:
    s = load(["--adapter", "sql=/a/sql", "--adapter", "chat-v2.1_x = ~/chat"])
    assert s.adapter == {"sql": Path("/a/sql"), "chat-v2.1_x": Path("~/chat")}
    assert s.engine_kwargs()["adapters"] == s.adapter
    env = load(LORA_GUARD_ADAPTER="a=/x,b=/y")
    assert env.adapter == {"a": Path("/x"), "b": Path("/y")}


@pytest.mark.parametrize(
    ("value", "match"),
    [
        ("../x=/p", "adapter name '../x'"),
        ("a/b=/p", "adapter name 'a/b'"),
        ("..=/p", "adapter name '..'"),
        ("a b=/p", "adapter name 'a b'"),
        ("sql", "expected NAME=PATH"),
        ("=/p", "expected NAME=PATH"),
        ("sql=", "expected NAME=PATH"),
    ],
)
def test_bad_adapters(value: str, match: str) -> None:
    with pytest.raises(SettingsError, match=rf"--adapter: bad value .*--adapter.*{match}"):
        load(["--adapter", value])


def test_bad_adapters_from_env_and_file(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match=r"LORA_GUARD_ADAPTER: adapter name 'a/b'"):
        load(LORA_GUARD_ADAPTER="a/b=/p")
    with pytest.raises(SettingsError, match=r"key 'adapter'.*adapter name 'a=b'"):
        load(["--config", str(toml(tmp_path, '[adapter]\n"a=b" = "/p"\n'))])
    with pytest.raises(SettingsError, match="adapter 'a' is given twice"):
        load(["--adapter", "a=/x", "--adapter", "a=/y"])


def test_repeatable_flags(tmp_path: Path) -> None:
    s = load(
        [
            "--disable-plugin",
            "metrics",
            "--disable-plugin",
            "kv-namespace",
            "--adapter-dir",
            "/one",
            "--adapter-dir",
            "/two",
        ],
    )
    assert s.disable_plugin == ("metrics", "kv-namespace")
    assert s.adapter_dir == (Path("/one"), Path("/two"))
    assert "metrics" not in s.hooks.names() and "kv-namespace" not in s.hooks.names()
    assert "metrics_window_s" not in s.options
    # the environment takes a comma list; a flag replaces it, it does not add to it
    s = load(LORA_GUARD_DISABLE_PLUGIN="metrics, hot-set")
    assert s.disable_plugin == ("metrics", "hot-set")
    s = load(["--disable-plugin", "cold-budget"], LORA_GUARD_DISABLE_PLUGIN="metrics")
    assert s.disable_plugin == ("cold-budget",)
    assert "metrics" in s.hooks.names()
    # a file takes a list or one string
    assert load(
        ["--config", str(toml(tmp_path, 'disable_plugin = "metrics"\n'))]
    ).disable_plugin == ("metrics",)


def test_plugin_flag_loads_a_plugin_whose_options_become_flags(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    module = f"lg_config_test_plugin_{next(_modules)}"
    (tmp_path / f"{module}.py").write_text(
        "from lora_guard.plugins import hookimpl\n"
        "class Plugin:\n"
        "    @hookimpl\n"
        "    def lora_guard_add_options(self, options):\n"
        "        options.add('max_loras', str, 'clash', 'a server setting: not added twice')\n"
        "        options.add('tenant_budget', int, 3, 'per-tenant budget')\n"
        "        options.add('strict', bool, False, 'a boolean option')\n"
        "plugin = Plugin()\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    spec = f"{module}:plugin"
    s = load(
        ["--plugin", spec, "--tenant-budget", "7", "--max-loras", "4"], LORA_GUARD_STRICT="yes"
    )
    assert s.plugin == (spec,)
    assert spec in s.hooks.names()
    assert s.options["tenant_budget"] == 7 and s.options["strict"] is True
    assert "max_loras" not in s.options and s.max_loras == 4
    assert s.plugin_settings()["max_loras"] == 4
    help_text = build_parser(s.hooks).format_help()  # a second --max-loras would raise
    assert "--tenant-budget" in help_text and "LORA_GUARD_TENANT_BUDGET" in help_text
    # the same plugin, named by the environment
    s = load(LORA_GUARD_PLUGIN=spec, LORA_GUARD_TENANT_BUDGET="9")
    assert s.options["tenant_budget"] == 9
    with pytest.raises(SettingsError, match="cannot import"):
        load(["--plugin", "no_such_module_for_lora_guard:x"])


@pytest.mark.parametrize(
    ("env", "expected"),
    [("1", True), ("true", True), ("YES", True), ("on", True), ("0", False), ("false", False)],
)
def test_no_prefix_caching_from_env(env: str, expected: bool) -> None:
    s = load(LORA_GUARD_NO_PREFIX_CACHING=env)
    assert s.no_prefix_caching is expected
    assert s.engine_kwargs()["enable_prefix_caching"] is not expected
    assert s.sources["no_prefix_caching"] == "environment variable LORA_GUARD_NO_PREFIX_CACHING"


def test_no_prefix_caching_flag_and_file(tmp_path: Path) -> None:
    assert load(["--no-prefix-caching"]).no_prefix_caching is True
    assert load(["--no-prefix-caching"], LORA_GUARD_NO_PREFIX_CACHING="0").no_prefix_caching
    path = toml(tmp_path, "no-prefix-caching = true\n")
    assert load(["--config", str(path)]).no_prefix_caching is True
    assert not load(["--config", str(path)], LORA_GUARD_NO_PREFIX_CACHING="false").no_prefix_caching


def test_policies_lru_removes_the_hot_set_options() -> None:
    s = load(["--policies", "lru"])
    assert s.policies == ("lru",)
    assert "hot-set" not in s.hooks.names()
    help_text = build_parser(s.hooks).format_help()
    for flag in ("--hot-set-size", "--pin", "--cold-loads-per-minute", "--kv-namespace-scope"):
        assert flag not in help_text
    assert "--metrics-window-s" in help_text
    with pytest.raises(SettingsError, match=r"unknown flag --hot-set-size .*'hot-set'.*not loaded"):
        load(["--policies", "lru", "--hot-set-size", "3"])
    with pytest.raises(SettingsError, match=r"unknown flag --hot-set-size"):
        load(["--hot-set-size", "3"], LORA_GUARD_POLICIES="lru")
    # the default policies have it
    assert load(["--hot-set-size", "3"]).options["hot_set_size"] == 3


def test_unknown_flags_and_arguments() -> None:
    with pytest.raises(SettingsError, match=r"unknown flag --max-lora \(did you mean --max-loras"):
        load(["--max-lora", "3"])  # no abbreviations
    with pytest.raises(SettingsError, match=r"unexpected argument 'model\.safetensors'"):
        load(["model.safetensors"])


def test_help_lists_every_flag_its_default_and_its_env_var() -> None:
    s = load()
    help_text = " ".join(build_parser(s.hooks).format_help().split())
    flags = {tok.rstrip(",") for tok in help_text.split() if tok.startswith("--")}
    for flag in DESIGN_FLAGS:
        assert flag in flags, flag
    for setting in SETTINGS:
        assert setting.flag in flags and setting.env in help_text, setting.name
    assert "--cold-loads-per-minute" in flags
    assert "env LORA_GUARD_COLD_LOADS_PER_MINUTE" in help_text
    assert "env LORA_GUARD_MAX_LORAS" in help_text
    assert "default: 0;" in help_text and "default: hot-set,cold-budget,kv-namespace;" in help_text
    # only the server's flags without plugins
    assert "--cold-loads-per-minute" not in build_parser(None).format_help()


def test_help_exits_zero(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        load(["--help"])
    assert exit_info.value.code == 0
    assert "LORA_GUARD_MAX_LORAS" in capsys.readouterr().out


def test_memory_sizes_are_read_by_the_engines_parse_memory() -> None:
    assert load(["--kv-cache-memory", "2GiB"]).kv_cache_memory == 2 * 2**30
    assert load(LORA_GUARD_CACHE_MEMORY="4096").cache_memory == 4096
    with pytest.raises(SettingsError, match=r"--kv-cache-memory: bad value '2 TiBs' from env"):
        load(LORA_GUARD_KV_CACHE_MEMORY="2 TiBs")
    with pytest.raises(SettingsError, match=r"--kv-cache-memory: .*must be positive"):
        load(["--kv-cache-memory", "0"])


def test_several_adapter_dirs(tmp_path: Path) -> None:
    for folder, names in {"one": ("a", "b"), "two": ("b", "c"), "three": ("d",)}.items():
        for name in names:
            (tmp_path / folder / name).mkdir(parents=True)
            (tmp_path / folder / name / "adapter_config.json").write_text("{}")
    (tmp_path / "three" / "not-an-adapter").mkdir()
    s = load(
        ["--adapter-dir", str(tmp_path / "one"), "--adapter", "d=/explicit"],
        LORA_GUARD_ADAPTER_DIR="ignored",
    )
    assert s.engine_kwargs()["adapter_dir"] == tmp_path / "one"
    argv = [f"--adapter-dir={tmp_path / d}" for d in ("one", "two", "three")]
    kwargs = load([*argv, "--adapter", "d=/explicit"]).engine_kwargs()
    assert kwargs["adapter_dir"] == tmp_path / "one"
    assert kwargs["adapters"] == {
        "b": tmp_path / "two" / "b",
        "c": tmp_path / "two" / "c",
        "d": Path("/explicit"),
    }
    with pytest.raises(SettingsError, match="cannot list it"):
        load(["--adapter-dir", "/a", "--adapter-dir", str(tmp_path / "nope")]).engine_kwargs()


def test_dtype_aliases_and_devices() -> None:
    s = load(["--dtype", "bf16", "--device", "CUDA:1"])
    assert (s.dtype, s.device) == ("bfloat16", "cuda:1")


def test_environ_argument_does_not_leak_into_os_environ() -> None:
    before = os.environ.get(DISABLE_AUTOLOAD_ENV)
    load()
    assert os.environ.get(DISABLE_AUTOLOAD_ENV) == before


def test_summary_names_every_source(tmp_path: Path) -> None:
    s = load(["--port", "1"], LORA_GUARD_HOST="0.0.0.0")
    lines: dict[str, Any] = {line.split(" = ")[0]: line for line in s.summary()}
    assert "(the command line (--port))" in lines["port"]
    assert "environment variable LORA_GUARD_HOST" in lines["host"]
    assert "cold_loads_per_minute" in lines
