"""Replay a trace against a running server (``lora-guard bench --target URL``).

Each request goes to TGI's ``/generate_stream`` at its trace time, on its own thread, with the
adapter in ``parameters.adapter_id`` and the tenant in ``X-Tenant-Id`` (the bench's load client,
``load.py``). A 429 is retried after its ``Retry-After``. The server's ``/metrics`` are read once a
second for the adapter lookups, swaps, cold loads and KV conflicts of the run (as differences from
the start).
"""

from __future__ import annotations

import math

import httpx
from prometheus_client.parser import text_string_to_metric_families

from lora_guard.bench import load
from lora_guard.bench.replay import SchemeRun
from lora_guard.workload.trace import TraceRequest

_POLL_S = 1.0


def replay_target(
    url: str, trace: list[TraceRequest], slots: int, name: str = "target", api_key: str = ""
) -> SchemeRun:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    lookups: list[tuple[float, bool]] = []
    with load.client(url, len(trace), headers) as http:
        before = _scrape(http)
        seen = _lookup_counts(before)

        def scrape(now: float) -> None:
            nonlocal seen
            seen = _record_lookups(_scrape(http), seen, now, lookups)

        records, duration = load.open_loop(http, trace, load.tgi_generate(), scrape, _POLL_S)
        after = _scrape(http)
        _record_lookups(after, seen, duration, lookups)
    return SchemeRun(
        scheme=name,
        records=records,
        swap_ms=_swap_samples(before, after),
        lookups=lookups,
        slots=slots
        or len({r.adapter_id for r in trace if r.adapter_id}),  # no cap given: every adapter
        kv_conflicts=int(_delta(before, after, "lora_guard_kv_namespace_conflict_total")),
        cold_loads={
            outcome: int(_delta(before, after, "lora_guard_cold_loads_total", outcome=outcome))
            for outcome in ("loaded", "rejected", "failed")
        },
        memory={},
        peak_rss=None,
        duration_s=duration,
        served=[r.adapter_id for r in trace],
    )


Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def _scrape(client: httpx.Client) -> Samples:
    reply = client.get("/metrics")
    reply.raise_for_status()
    samples: Samples = {}
    for family in text_string_to_metric_families(reply.text):
        for sample in family.samples:
            samples[sample.name, tuple(sorted(sample.labels.items()))] = sample.value
    return samples


def _delta(before: Samples, after: Samples, name: str, **labels: str) -> float:
    key = (name, tuple(sorted(labels.items())))
    return after.get(key, 0.0) - before.get(key, 0.0)


def _lookup_counts(samples: Samples) -> tuple[float, float]:
    hot = _delta({}, samples, "lora_guard_adapter_lookups_total", result="hot")
    total = sum(
        _delta({}, samples, "lora_guard_adapter_lookups_total", result=result)
        for result in ("hot", "warm", "cold")
    )
    return hot, total


def _record_lookups(
    samples: Samples,
    seen: tuple[float, float],
    now: float,
    lookups: list[tuple[float, bool]],
) -> tuple[float, float]:
    hot, total = _lookup_counts(samples)
    new_hot, new_total = int(hot - seen[0]), int(total - seen[1])
    lookups.extend([(now, True)] * new_hot + [(now, False)] * (new_total - new_hot))
    return hot, total


def _swap_samples(before: Samples, after: Samples) -> list[float]:
    """Swap times rebuilt from the histogram's buckets: each swap at its bucket's midpoint."""
    name = "lora_guard_adapter_swap_ms_bucket"
    buckets = sorted(
        (float(value), value)
        for metric, labels in after
        if metric == name
        for key, value in labels
        if key == "le"
    )
    samples: list[float] = []
    below, low = 0, 0.0
    for bound, le in buckets:
        count = int(_delta(before, after, name, le=le))
        samples += [low if math.isinf(bound) else (low + bound) / 2] * (count - below)
        below, low = count, bound
    return samples
