"""The command line answers at once: its help, ``plugins``, ``simulate`` without ``--calibrate``
and the checks of ``serve``'s settings import no torch (nor the rest of the engine's weight).

Each command runs in a fresh interpreter, as ``lora-guard`` would, and the child reports which
heavy modules it imported.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

#: Modules that take a second or more to import between them, and that only the engine, the
#: HTTP server or a measurement needs.
HEAVY = ("torch", "numpy", "safetensors", "transformers", "peft", "fastapi", "uvicorn")

_CHILD = """
import contextlib, io, json, sys
from lora_guard.cli import main
out = io.StringIO()
with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
    try:
        code = main(json.loads(sys.argv[1]))
    except SystemExit as exc:  # --help, --version and usage errors exit
        code = exc.code
heavy = [name for name in json.loads(sys.argv[2]) if name in sys.modules]
print(json.dumps({"code": code, "heavy": heavy, "output": out.getvalue()}))
"""

SIMULATE_SMALL = [
    "simulate", "--adapters", "20", "--replicas", "2", "--requests", "200",
    "--routers", "lora-guard",
]  # fmt: skip


def _run(argv: list[str]) -> dict[str, object]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LORA_GUARD_")}
    env["LORA_GUARD_DISABLE_PLUGIN_AUTOLOAD"] = "1"  # only lora-guard's own plugins
    child = subprocess.run(
        [sys.executable, "-c", _CHILD, json.dumps(argv), json.dumps(HEAVY)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=True,
    )
    result: dict[str, object] = json.loads(child.stdout.strip().splitlines()[-1])
    return result


#: (the command's arguments, its exit code, what its output says)
CASES = [
    (["--help"], 0, "usage: lora-guard"),
    (["--version"], 0, "lora-guard "),
    (["plugins"], 0, "metrics:"),
    (["simulate", "--help"], 0, "usage: lora-guard simulate"),
    (SIMULATE_SMALL, 0, "| replicas | router |"),
    (["serve", "--help"], 0, "--max-loras"),
    (["serve", "--max-loras", "x"], 2, "--max-loras: bad value 'x'"),
    (["serve", "--dtype", "fp64"], 2, "--dtype: bad value 'fp64'"),
    (["bench", "--help"], 0, "usage: lora-guard bench"),
    (["train-adapter", "--help"], 0, "usage: lora-guard train-adapter"),
    (["make-adapters", "--help"], 0, "usage: lora-guard make-adapters"),
    (["prepare-demo", "--help"], 0, "usage: lora-guard prepare-demo"),
]


@pytest.mark.parametrize(("argv", "code", "says"), CASES, ids=[" ".join(c[0]) for c in CASES])
def test_command_imports_no_torch(argv: list[str], code: int, says: str) -> None:
    result = _run(argv)
    assert says in str(result["output"]), result["output"]
    assert result["code"] == code, result["output"]
    assert result["heavy"] == [], f"lora-guard {' '.join(argv)} imported {result['heavy']}"


def test_engine_config_imports_no_torch() -> None:
    """The settings table and the docs' tables are made without torch; the engine's names are
    still there, imported when read."""
    code = (
        "import sys, lora_guard.config, lora_guard.settings_docs, lora_guard.engine as e;"
        "lora_guard.settings_docs.settings_markdown(); lora_guard.settings_docs.llm_markdown();"
        "assert 'torch' not in sys.modules, 'torch imported';"
        "assert e.ConfigError.__module__ == 'lora_guard.engine.values';"
        "assert 'torch' not in sys.modules, 'torch imported by ConfigError';"
        "assert e.LLM.__name__ == 'LLM' and 'torch' in sys.modules;"
        "assert set(e.__all__) <= set(dir(e))"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
