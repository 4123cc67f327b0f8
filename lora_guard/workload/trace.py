"""A seeded multi-adapter workload, and its JSONL trace.

Each line of a trace is one request::

    {"id": "r0001", "time": 0.42, "tenant": "t2", "adapter_id": "demo-05",
     "prompt": "...", "max_new_tokens": 180}

``time`` is seconds from the start; ``adapter_id`` may be null (the base model); a line may give
``prompt_len`` (words) instead of ``prompt``, and a prompt of that many words is made up for it.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Iterable, Sequence
from dataclasses import asdict, replace
from pathlib import Path

from lora_guard.workload.draw import Draw
from lora_guard.workload.scenarios import SCENARIOS as SCENARIOS
from lora_guard.workload.scenarios import scenario
from lora_guard.workload.spec import _WORDS as _WORDS
from lora_guard.workload.spec import TraceError as TraceError
from lora_guard.workload.spec import TraceRequest as TraceRequest
from lora_guard.workload.spec import WorkloadSpec as WorkloadSpec
from lora_guard.workload.spec import _words as _words
from lora_guard.workload.spec import mean_rate as mean_rate


def make_trace(spec: WorkloadSpec, adapter_ids: Sequence[str]) -> list[TraceRequest]:
    """Requests drawn from ``spec`` as its scenario (``scenarios.SCENARIOS``) makes them."""
    chosen = scenario(spec.scenario)
    chosen.check(spec, adapter_ids)
    if chosen.generate is not None:
        return chosen.generate(spec, adapter_ids)
    adapters = list(adapter_ids[: spec.adapters])
    draw = Draw(spec, len(adapters), chosen.even, chosen.reserved)
    arrivals = draw.arrivals(chosen.drift)
    if chosen.reshape is not None:
        chosen.reshape(draw, arrivals)
    arrivals.sort(key=lambda a: a.time)
    return [
        TraceRequest(
            id=f"r{n:04d}",
            time=round(a.time, 3),
            tenant=f"t{a.tenant}",
            adapter_id=adapters[a.index] if a.index is not None else None,
            prompt=a.prompt,
            max_new_tokens=a.max_new_tokens,
        )
        for n, a in enumerate(arrivals)
    ]


def fresh_trace(spec: WorkloadSpec, adapter_ids: Sequence[str], n: int) -> list[TraceRequest]:
    """``n`` requests of ``spec``'s trace whose prompts are all different: a request repeating an
    earlier one's whole prompt is left out (a server that saw it would answer from its prefix
    cache, and it would measure the cache, not the engine). Tenants' system prompts stay shared."""
    drawn = n
    for _ in range(8):
        seen: set[str] = set()
        kept = []
        for r in make_trace(replace(spec, requests=drawn), adapter_ids):
            if r.prompt not in seen:
                seen.add(r.prompt)
                kept.append(r)
        if len(kept) >= n:
            return kept[:n]
        drawn *= 2
    raise TraceError(
        f"the workload makes only {len(kept)} different prompts of the {n} asked; "
        "give longer user turns (--user-words)"
    )


def write_trace(trace: Iterable[TraceRequest], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for request in trace:
            f.write(json.dumps(asdict(request)) + "\n")


def read_trace(path: Path) -> list[TraceRequest]:
    """Read a JSONL trace, sorted by time. Raises :class:`TraceError` naming the bad line."""
    trace = []
    with path.open() as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                trace.append(_request(json.loads(line), number))
            except (ValueError, TypeError, KeyError) as exc:
                raise TraceError(f"{path}:{number}: {exc}") from None
    if not trace:
        raise TraceError(f"{path}: the trace holds no requests")
    ids = [r.id for r in trace]
    if len(set(ids)) != len(ids):
        raise TraceError(f"{path}: request ids must be unique")
    return sorted(trace, key=lambda r: r.time)


def _request(line: dict[str, object], number: int) -> TraceRequest:
    time, max_new = float(line["time"]), line["max_new_tokens"]  # type: ignore[arg-type]
    if not (math.isfinite(time) and time >= 0):
        raise ValueError(f"time must be a finite number >= 0, got {line['time']!r}")
    if not isinstance(max_new, int) or max_new < 1:
        raise ValueError(f"max_new_tokens must be a positive integer, got {max_new!r}")
    adapter = line.get("adapter_id")
    if adapter is not None and not isinstance(adapter, str):
        raise ValueError(f"adapter_id must be a string or null, got {adapter!r}")
    if "prompt" in line:
        prompt = line["prompt"]
        if not isinstance(prompt, str) or not prompt:
            raise ValueError("prompt must be a non-empty string")
    else:
        words = line["prompt_len"]
        if not isinstance(words, int) or words < 1:
            raise ValueError(f"prompt_len must be a positive integer, got {words!r}")
        prompt = _words(random.Random(number), words - 1, "Request:")
    return TraceRequest(
        id=str(line.get("id", f"line{number}")),
        time=time,
        tenant=str(line.get("tenant", "default")),
        adapter_id=adapter,
        prompt=prompt,
        max_new_tokens=max_new,
    )
