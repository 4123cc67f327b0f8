"""The engine's usage record: the one sliding window, and pins kept once."""

from __future__ import annotations

import pytest

from lora_guard.engine.usage import AdapterUsage, SlidingWindow


def test_the_window_counts_by_key_and_forgets_old_events() -> None:
    now = [0.0]
    window: SlidingWindow[str] = SlidingWindow(10.0, clock=lambda: now[0])
    assert window.share("a") == 0.0 and window.counts() == {} and window.total() == 0
    window.add("a")
    now[0] = 5.0
    window.add("b")
    window.add("a")
    assert window.counts() == {"a": 2, "b": 1}
    assert window.times() == (0.0, 5.0, 5.0)
    assert window.share("a") == pytest.approx(2 / 3)
    assert window.counts(now=10.0) == {"a": 1, "b": 1}  # the first "a" left the window
    now[0] = 16.0
    assert window.counts() == {} and window.total() == 0
    assert window.share("a") == 0.0  # nothing left: 0, never NaN


def test_the_window_stays_bounded_when_nobody_reads_it() -> None:
    now = [0.0]
    window: SlidingWindow[bool] = SlidingWindow(1.0, clock=lambda: now[0])
    for i in range(1000):
        now[0] = i * 0.1
        window.add(True)
    assert len(window.times()) <= 11


def test_heat_is_counted_per_tenant_and_adapter() -> None:
    usage = AdapterUsage(max_loras=4)
    for tenant, adapter in [("acme", "x"), ("acme", "x"), ("globex", "x"), ("globex", "y")]:
        usage.arrived(tenant, adapter)
    assert usage.heat() == {"x": 3, "y": 1}
    assert usage.tenant_heat() == {("acme", "x"): 2, ("globex", "x"): 1, ("globex", "y"): 1}


def test_pins_leave_one_seat_for_the_others() -> None:
    usage = AdapterUsage(max_loras=3)
    usage.pin("a", "b", "a")
    assert usage.pinned == ("a", "b")
    with pytest.raises(ValueError, match="would leave no slot"):
        usage.pin("c")
    usage.unpin("a")
    usage.pin("c")
    assert usage.pinned == ("b", "c")
