"""A bench run in a process of its own, so that its peak memory is its own."""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from typing import Any, TypeVar

from lora_guard.bench.replay import SchemeRun

T = TypeVar("T")


def call_in_process(isolated: bool, fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)``: with ``isolated``, in a fresh process (its peak RSS is its own), else
    here (no RSS figure)."""
    if not isolated:
        result = fn(*args)
        if isinstance(result, SchemeRun):
            result.peak_rss = None
        return result
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=1, mp_context=context) as pool:
        return pool.submit(fn, *args).result()
