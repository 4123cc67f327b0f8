"""The tests' own helpers (lora_guard.demo.testing)."""

from __future__ import annotations

import pytest

from lora_guard.demo.testing import eventually


def test_eventually_returns_the_first_truthy_value() -> None:
    answers = iter([0, None, ValueError("not yet"), "ready"])

    def check() -> object:
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer

    assert eventually(check, timeout_s=5, interval_s=0.001) == "ready"


def test_eventually_names_what_it_waited_for_and_the_last_answer() -> None:
    with pytest.raises(AssertionError, match=r"the queue to drain: last \[\]"):
        eventually(list, timeout_s=0.05, what="the queue to drain")

    def fails() -> bool:
        raise KeyError("no such metric")

    with pytest.raises(AssertionError, match="a metric: last KeyError"):
        eventually(fails, timeout_s=0.05, what="a metric")
