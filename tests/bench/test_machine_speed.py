"""The machine's own speed, which the capacity sweep records before each point."""

from __future__ import annotations

import pytest

from lora_guard.bench.machine_speed import machine_speed, main


def test_the_speed_is_a_rate_and_the_command_prints_its_spread(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert machine_speed(0.05) > 0
    assert main(["--seconds", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[:2] for line in lines[:2]] == [["1", "s"], ["2", "s"]]
    assert lines[2].startswith("min ") and "(max/min " in lines[2]
    with pytest.raises(SystemExit):
        main(["--seconds", "0"])
