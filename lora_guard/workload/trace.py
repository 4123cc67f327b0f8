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
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from lora_guard.workload.spec import _WORDS as _WORDS
from lora_guard.workload.spec import TraceError as TraceError
from lora_guard.workload.spec import TraceRequest as TraceRequest
from lora_guard.workload.spec import WorkloadSpec as WorkloadSpec
from lora_guard.workload.spec import _words as _words
from lora_guard.workload.spec import mean_rate as mean_rate

SCENARIOS = ("zipf", "uniform", "burst", "tenant-storm", "pressure", "public", "seed")
BURST_ADAPTERS = 12  # adapters the cold tenant of the ``burst`` scenario brings at once
STORM_FACTOR = 8.0  # the flooding tenant's arrival rate over everyone else's, in ``tenant-storm``


#: What ``pressure`` changes in a spec (``pressure_spec``): many adapters, many tenants.
PRESSURE = {"adapters": 200, "tenants": 8}


def pressure_spec(spec: WorkloadSpec, **given: object) -> WorkloadSpec:
    """``spec`` as the ``pressure`` scenario runs it: :data:`PRESSURE` where ``given`` (the
    settings a user named) does not say otherwise."""
    return replace(spec, scenario="pressure", **{**PRESSURE, **given})  # type: ignore[arg-type]


#: What ``public`` changes in a spec (``public_spec``): an adapter for each LoRA of the Alibaba
#: trace, 8 tenants, a shorter system prompt (256 tokens at the prompt scale), and no bursts of
#: the spec's own (the trace brings its own, so ``rate`` is the mean rate).
PUBLIC = {"adapters": 229, "tenants": 8, "system_prompt_words": 32, "burst_factor": 1.0}


def public_spec(spec: WorkloadSpec, **given: object) -> WorkloadSpec:
    """``spec`` as the ``public`` scenario runs it: :data:`PUBLIC` where ``given`` does not say
    otherwise."""
    return replace(spec, scenario="public", **{**PUBLIC, **given})  # type: ignore[arg-type]


def make_trace(spec: WorkloadSpec, adapter_ids: Sequence[str]) -> list[TraceRequest]:
    """Requests drawn from ``spec``: adapter ``adapter_ids[i]`` has Zipf weight ``1/(i+1)**zipf``
    and belongs to tenant ``i % tenants``; each tenant has its own system prompt."""
    if spec.scenario not in SCENARIOS:
        raise TraceError(f"unknown scenario {spec.scenario!r}; choose from {', '.join(SCENARIOS)}")
    if len(adapter_ids) < spec.adapters:
        raise TraceError(f"the workload needs {spec.adapters} adapters, {len(adapter_ids)} given")
    if spec.scenario == "burst" and spec.adapters <= BURST_ADAPTERS:
        raise TraceError(f"the burst scenario needs more than {BURST_ADAPTERS} adapters")
    if spec.scenario == "public":
        from lora_guard.workload.public import public_trace

        return public_trace(spec, adapter_ids).requests
    rng = random.Random(spec.seed)
    adapters = list(adapter_ids[: spec.adapters])
    exponent = 0.0 if spec.scenario == "uniform" else spec.zipf
    weights = [1 / (i + 1) ** exponent for i in range(len(adapters))]
    if spec.scenario == "burst":
        weights[-BURST_ADAPTERS:] = [0.0] * BURST_ADAPTERS  # the cold tenant's, unused until then
    system = [_words(rng, spec.system_prompt_words, f"Tenant {t}.") for t in range(spec.tenants)]
    # Lognormal output lengths with the asked mean; sigma 0.6 gives a long tail.
    sigma = 0.6
    mu = math.log(spec.output_mean) - sigma**2 / 2

    def request(time: float, tenant: int, index: int | None) -> _Arrival:
        user_words = max(1, round(rng.expovariate(1 / spec.user_words_mean)))
        prompt = f"{system[tenant]}\nUser: {_words(rng, user_words, 'Question:')}\nAssistant:"
        out = min(spec.output_max, max(spec.output_min, round(rng.lognormvariate(mu, sigma))))
        return _Arrival(time, tenant, index, prompt, out)

    arrivals: list[_Arrival] = []
    now, next_drift = 0.0, spec.drift_every_s
    ranking = list(range(len(adapters)))  # popularity place -> adapter index
    for _ in range(spec.requests):
        in_burst = (now % spec.burst_every_s) < spec.burst_len_s
        now += rng.expovariate(spec.rate * (spec.burst_factor if in_burst else 1.0))
        while spec.scenario == "pressure" and now >= next_drift:
            _drift(rng, ranking, spec)
            next_drift += spec.drift_every_s
        if rng.random() < spec.base_share:
            arrivals.append(request(now, rng.randrange(spec.tenants), None))
        else:
            index = ranking[rng.choices(range(len(adapters)), weights=weights)[0]]
            arrivals.append(request(now, index % spec.tenants, index))
    if spec.scenario == "burst":
        # Halfway through, a new tenant sends one request for each of its 12 adapters, 10 ms
        # apart, in place of as many of the arrivals that follow (the length stays as asked).
        system.append(_words(rng, spec.system_prompt_words, f"Tenant {spec.tenants}."))
        middle = len(arrivals) // 2
        start = arrivals[middle].time
        del arrivals[middle : middle + BURST_ADAPTERS]
        first = len(adapters) - BURST_ADAPTERS
        arrivals += [
            request(start + 0.01 * k, spec.tenants, first + k) for k in range(BURST_ADAPTERS)
        ]
    if spec.scenario == "tenant-storm":
        # Over the middle third, tenant 0 adds STORM_FACTOR times the other tenants' arrivals
        # there, on its own adapters (the trace grows by the flood).
        low, high = arrivals[-1].time / 3, 2 * arrivals[-1].time / 3
        own = [i for i in range(len(adapters)) if i % spec.tenants == 0]
        others = sum(1 for a in arrivals if low <= a.time < high and a.tenant != 0)
        for _ in range(round(STORM_FACTOR * max(others, 1))):
            index = rng.choices(own, weights=[weights[i] for i in own])[0]
            arrivals.append(request(rng.uniform(low, high), 0, index))
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


def _drift(rng: random.Random, ranking: list[int], spec: WorkloadSpec) -> None:
    """Hand some of the most popular places to adapters from the rest of the ranking."""
    hot = min(spec.hot_ranks, len(ranking) - 1)
    for place in range(hot):
        if rng.random() < spec.drift_share:
            other = rng.randrange(hot, len(ranking))
            ranking[place], ranking[other] = ranking[other], ranking[place]


@dataclass(frozen=True)
class _Arrival:
    time: float
    tenant: int
    index: int | None  # into the adapters; None for the base model
    prompt: str
    max_new_tokens: int


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
