"""Replay a trace against a running server (``lora-guard bench --target URL``).

Each request goes to TGI's ``/generate_stream`` at its trace time, on its own thread, with the
adapter in ``parameters.adapter_id`` and the tenant in ``X-Tenant-Id``. A 429 is retried after its
``Retry-After``. The server's ``/metrics`` are read once a second for the adapter lookups, swaps,
cold loads and KV conflicts of the run (as differences from the start).
"""

from __future__ import annotations

import json
import math
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from lora_guard.bench.replay import RequestRecord, SchemeRun
from lora_guard.clock import monotonic
from lora_guard.workload.trace import TraceRequest

_POLL_S = 1.0
_MAX_RETRIES = 100


def replay_target(
    url: str, trace: list[TraceRequest], slots: int, name: str = "target", api_key: str = ""
) -> SchemeRun:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    client = httpx.Client(base_url=url.rstrip("/"), headers=headers, timeout=httpx.Timeout(600.0))
    before = _scrape(client)
    records = {r.id: RequestRecord(r.id, r.adapter_id, r.time) for r in trace}
    lookups: list[tuple[float, bool]] = []
    start = monotonic()
    threads = [
        threading.Thread(target=_send, args=(client, r, records[r.id], start), daemon=True)
        for r in trace
    ]
    for thread in threads:
        thread.start()
    seen = _lookup_counts(before)
    while any(t.is_alive() for t in threads):
        time.sleep(_POLL_S)
        seen = _record_lookups(_scrape(client), seen, monotonic() - start, lookups)
    duration = monotonic() - start
    after = _scrape(client)
    _record_lookups(after, seen, duration, lookups)
    client.close()
    return SchemeRun(
        scheme=name,
        records=list(records.values()),
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


def _send(client: httpx.Client, request: TraceRequest, record: RequestRecord, start: float) -> None:
    time.sleep(max(0.0, request.time - (monotonic() - start)))
    parameters: dict[str, Any] = {"max_new_tokens": request.max_new_tokens, "details": True}
    if request.adapter_id is not None:
        parameters["adapter_id"] = request.adapter_id
    body = {"inputs": request.prompt, "parameters": parameters}
    headers = {"X-Tenant-Id": request.tenant}
    try:
        while True:
            with client.stream("POST", "/generate_stream", json=body, headers=headers) as reply:
                if reply.status_code == 429 and record.retries < _MAX_RETRIES:
                    record.retries += 1
                    time.sleep(float(reply.headers.get("retry-after", "1")))
                    continue
                if reply.status_code != 200:
                    reply.read()
                    record.error = f"{reply.status_code}: {reply.text[:200]}"
                    break
                for event in _events(reply.iter_lines()):
                    if "error" in event:
                        record.error = str(event["error"])
                        break
                    if record.first_token is None:
                        record.first_token = monotonic() - start
                    record.tokens.append(int(event["token"]["id"]))
                break
    except (httpx.HTTPError, ValueError, KeyError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"
    record.finish = monotonic() - start


def _events(lines: Iterator[str]) -> Iterator[dict[str, Any]]:
    for line in lines:
        if line.startswith("data:"):
            event: dict[str, Any] = json.loads(line[5:])
            yield event


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
