"""The machine's clocks are read in ``lora_guard/clock.py`` alone: everything else takes a clock
or asks that module, so a replay can hand the engine its own time."""

from __future__ import annotations

import ast
from pathlib import Path

import lora_guard
from lora_guard import clock

READINGS = {"monotonic", "time", "perf_counter", "monotonic_ns", "time_ns", "perf_counter_ns"}


def direct_readings(path: Path) -> list[str]:
    """``time.<reading>`` and ``from time import <reading>`` in one file, as file:line."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id == "time"
            and node.attr in READINGS
        ) or (
            isinstance(node, ast.ImportFrom)
            and node.module == "time"
            and any(alias.name in READINGS for alias in node.names)
        ):
            found.append(f"{path}:{node.lineno}")
    return found


def test_no_module_but_the_clock_reads_the_machines_clocks() -> None:
    root = Path(lora_guard.__file__).parent
    found = [
        hit
        for path in sorted(root.rglob("*.py"))
        if path != root / "clock.py"
        for hit in direct_readings(path)
    ]
    assert not found, f"read the clock through lora_guard.clock: {found}"


def test_the_scan_finds_a_direct_reading(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text("import time\nfrom time import perf_counter\nstarted = time.monotonic()\n")
    assert direct_readings(sample) == [f"{sample}:2", f"{sample}:3"]


def test_the_clocks_move_as_their_names_say() -> None:
    first, started = clock.monotonic(), clock.timer()
    assert clock.monotonic() >= first
    assert clock.timer() >= started
    assert clock.wall() > 1.7e9  # seconds since the epoch, after 2023
