"""An installed plugin loads by its entry point, and the ways to keep it out work.

The example plugin ``hooks/tenant-quota`` is installed with pip into a temporary folder; each check
runs in a fresh interpreter with only that folder on ``PYTHONPATH``, as a user's would.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from lora_guard.plugins.manager import DISABLE_AUTOLOAD_ENV, ENTRY_POINT_GROUP

PLUGIN_SOURCE = Path(__file__).resolve().parents[1] / "hooks" / "tenant-quota"
NAME = "tenant-quota"
MODULE = "lora_guard_tenant_quota"

# What make_plugin_manager() registered, whether the plugin's module was imported at all, and
# where it was imported from.
MANAGER_SCRIPT = """
import json, sys
from lora_guard.plugins import make_plugin_manager

def loaded(**kwargs):
    pm = make_plugin_manager(**kwargs)
    plugin = pm.get_plugin("tenant-quota")
    return {
        "names": sorted(n for n, p in pm.list_name_plugin() if p is not None),
        "file": getattr(plugin, "__file__", None),
    }

report = {"disabled": loaded(disabled=["tenant-quota"])}
report["imported when disabled"] = "lora_guard_tenant_quota" in sys.modules
report["default"] = loaded()
report["policies=()"] = loaded(policies=())
report["imported"] = "lora_guard_tenant_quota" in sys.modules
print(json.dumps(report))
"""

LLM_SCRIPT = """
import json, sys
from lora_guard import LLM, SamplingParams
import lora_guard_tenant_quota

llm = LLM(sys.argv[1], policies=(), kv_cache_memory="4MiB", settings={"tenant_slot_quota": 2})
options = llm.engine.hooks.options.options
print(json.dumps({
    "names": llm.engine.hooks.names(),
    "options": {k: [o.default, o.help] for k, o in options.items() if k.startswith("tenant_")},
    "slot_quota": lora_guard_tenant_quota.quota_settings().slot_quota,
    "output": llm.generate("The quick", SamplingParams(max_new_tokens=3, ignore_eos=True))[0].text,
}))
"""


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The example plugin, installed with pip into a folder of its own."""
    tmp = tmp_path_factory.mktemp("entry-points")
    # Build from a copy: an in-tree setuptools build writes build/ and *.egg-info into the source.
    source = tmp / "src"
    skip = shutil.ignore_patterns("build", "*.egg-info", "__pycache__", "tests")
    shutil.copytree(PLUGIN_SOURCE, source, ignore=skip)
    target = tmp / "site"
    command = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "--no-deps",
        "--no-build-isolation",
        "--no-index",
        "--disable-pip-version-check",
        "--quiet",
        "--target",
        str(target),
        str(source),
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"pip install failed:\n{done.stdout}\n{done.stderr}"
    entry_points = next(target.glob("lora_guard_tenant_quota-*.dist-info")) / "entry_points.txt"
    assert entry_points.read_text().split() == [f"[{ENTRY_POINT_GROUP}]", NAME, "=", MODULE]
    return target


def _run(site: Path, script: str, *args: str, autoload: bool = True) -> Any:
    env = {k: v for k, v in os.environ.items() if k != DISABLE_AUTOLOAD_ENV}
    env["PYTHONPATH"] = str(site)
    if not autoload:
        env[DISABLE_AUTOLOAD_ENV] = "1"
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, f"the script failed:\n{done.stdout}\n{done.stderr}"
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def autoload_report(site: Path) -> Any:
    return _run(site, MANAGER_SCRIPT)


def test_installed_plugin_loads_by_entry_point(site: Path, autoload_report: Any) -> None:
    for case in ("default", "policies=()"):
        assert NAME in autoload_report[case]["names"], autoload_report
        assert autoload_report[case]["file"].startswith(str(site)), "not the installed copy"
    assert "hot-set" in autoload_report["default"]["names"]  # the built-ins load next to it
    assert "hot-set" not in autoload_report["policies=()"]["names"]


def test_a_disabled_plugin_is_not_loaded(autoload_report: Any) -> None:
    assert NAME not in autoload_report["disabled"]["names"]
    assert autoload_report["disabled"]["file"] is None
    assert autoload_report["imported when disabled"] is False, "its module was imported anyway"


def test_autoload_off_loads_no_entry_point(site: Path) -> None:
    report = _run(site, MANAGER_SCRIPT, autoload=False)
    for case in ("default", "policies=()", "disabled"):
        assert NAME not in report[case]["names"], report
    assert report["imported"] is False, "the plugin's module was imported anyway"
    assert "hot-set" in report["default"]["names"]  # the built-ins still load


def test_an_engine_picks_up_the_installed_plugin(site: Path, tiny_model: Path) -> None:
    report = _run(site, LLM_SCRIPT, str(tiny_model))
    assert NAME in report["names"]
    defaults = {name: default for name, (default, _) in report["options"].items()}
    assert defaults == {"tenant_slot_quota": 0, "tenant_queue_share": 1.0}
    assert "device slots" in report["options"]["tenant_slot_quota"][1]
    assert report["slot_quota"] == 2, "LLM(settings=...) did not reach the plugin"
    assert report["output"], "the engine with the plugin produced nothing"


def test_the_command_line_lists_it_and_disable_plugin_turns_it_off(site: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(site)}
    env.pop(DISABLE_AUTOLOAD_ENV, None)
    command = [sys.executable, "-m", "lora_guard.cli", "plugins"]
    listed = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)
    assert listed.returncode == 0, listed.stderr
    assert "tenant-quota: " in listed.stdout
    assert "--tenant-slot-quota" in listed.stdout

    off = subprocess.run(
        [*command, "--disable-plugin", "tenant-quota"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert off.returncode == 0, off.stderr
    assert "tenant-quota" not in off.stdout
    assert "hot-set: " in off.stdout and "metrics: " in off.stdout
