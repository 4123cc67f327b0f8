"""One hypothesis seed a run, drawn fresh unless ``--hypothesis-seed`` names one, and printed in
the report's header: every run tries new examples, and a failure is re-run with its seed (then
kept as an ``@example``)."""

from __future__ import annotations

import random

import pytest


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    if getattr(config.option, "hypothesis_seed", None) is None:
        config.option.hypothesis_seed = random.randrange(2**32)


def pytest_report_header(config: pytest.Config) -> str:
    seed = getattr(config.option, "hypothesis_seed", None)
    return f"hypothesis seed: {seed} (re-run this run's examples with --hypothesis-seed={seed})"
