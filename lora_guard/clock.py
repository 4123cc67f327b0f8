"""The machine's clocks, read in this one place.

Three readings, each for one purpose:

- :func:`monotonic`: seconds that never go back. The engine's clock when it is given none
  (arrivals, the heat window, the residency quantum), deadlines, and the bench's request
  times. A replay in virtual time gives the engine its own clock instead.
- :func:`wall`: seconds since the epoch, for times a user or another process reads (OpenAI's
  ``created``, a step record's timestamp, vLLM's arrival times, a file's age).
- :func:`timer`: the stopwatch, the finest reading, for how long a piece of work took
  (``started = timer()`` ... ``timer() - started``).

A test holds that nothing else in ``lora_guard`` reads ``time.monotonic``, ``time.time`` or
``time.perf_counter``, so what drives the engine's time is always a clock it was handed.
"""

from __future__ import annotations

import time


def monotonic() -> float:
    """Seconds on a clock that never goes back (its zero means nothing)."""
    return time.monotonic()


def wall() -> float:
    """Seconds since the epoch."""
    return time.time()


def timer() -> float:
    """The stopwatch: seconds on the finest clock, for the length of a piece of work."""
    return time.perf_counter()
