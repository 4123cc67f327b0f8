"""The bench's workload: seeded, Zipf-skewed, tenant prefixes, and a JSONL trace users can edit."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest

from lora_guard.workload.scenarios import SCENARIOS
from lora_guard.workload.stats import percentile
from lora_guard.workload.trace import (
    TraceError,
    TraceRequest,
    WorkloadSpec,
    make_trace,
    read_trace,
    write_trace,
)

ADAPTERS = [f"demo-{i:02d}" for i in range(24)]


def test_the_same_seed_gives_the_same_trace_and_another_seed_another() -> None:
    spec = WorkloadSpec(requests=50)
    assert make_trace(spec, ADAPTERS) == make_trace(spec, ADAPTERS)
    assert make_trace(spec, ADAPTERS) != make_trace(WorkloadSpec(requests=50, seed=1), ADAPTERS)


def test_popularity_is_zipf_skewed_and_outputs_have_the_asked_mean() -> None:
    trace = make_trace(WorkloadSpec(requests=2000, output_max=2000), ADAPTERS)
    counts = Counter(r.adapter_id for r in trace)
    # Zipf(1) over 24 adapters: the first takes 1/H(24) = 26.5%, the second half of that.
    assert 0.22 < counts["demo-00"] / len(trace) < 0.31
    assert 1.6 < counts["demo-00"] / counts["demo-01"] < 2.5
    mean = sum(r.max_new_tokens for r in trace) / len(trace)
    assert 165 < mean < 195
    times = [r.time for r in trace]
    assert times == sorted(times) and times[0] > 0


def test_requests_of_a_tenant_share_its_system_prompt() -> None:
    trace = make_trace(WorkloadSpec(requests=60), ADAPTERS)
    by_tenant: dict[str, set[str]] = {}
    for request in trace:
        by_tenant.setdefault(request.tenant, set()).add(request.prompt.split("\nUser:")[0])
    assert len(by_tenant) > 1
    assert all(len(prefixes) == 1 for prefixes in by_tenant.values())
    assert len({next(iter(p)) for p in by_tenant.values()}) == len(by_tenant)


def test_a_trace_survives_a_round_trip_through_jsonl(tmp_path: Path) -> None:
    trace = make_trace(WorkloadSpec(requests=20, base_share=0.3), ADAPTERS)
    write_trace(trace, tmp_path / "trace.jsonl")
    assert read_trace(tmp_path / "trace.jsonl") == trace
    assert any(r.adapter_id is None for r in trace)


def test_a_line_may_give_a_prompt_length_instead_of_a_prompt(tmp_path: Path) -> None:
    path = tmp_path / "mine.jsonl"
    path.write_text(
        json.dumps({"time": 1.5, "adapter_id": "demo-03", "prompt_len": 40, "max_new_tokens": 9})
        + "\n\n"
        + json.dumps({"id": "x", "time": 0.5, "prompt": "Hello", "max_new_tokens": 3})
        + "\n"
    )
    first, second = read_trace(path)
    assert (first.id, first.time, first.prompt) == ("x", 0.5, "Hello")
    assert len(second.prompt.split()) == 40 and second.adapter_id == "demo-03"


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"time": -1, "prompt": "a", "max_new_tokens": 3}', "time"),
        ('{"time": 0, "prompt": "a", "max_new_tokens": 0}', "max_new_tokens"),
        ('{"time": 0, "prompt": "", "max_new_tokens": 3}', "prompt"),
        ('{"time": 0, "max_new_tokens": 3}', "prompt_len"),
        ('{"time": 0, "prompt": "a", "max_new_tokens": 3, "adapter_id": 7}', "adapter_id"),
        ("not json", "line"),
    ],
)
def test_a_bad_line_is_named_in_the_error(tmp_path: Path, line: str, message: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"time": 0, "prompt": "ok", "max_new_tokens": 3}\n' + line + "\n")
    with pytest.raises(TraceError, match=r"bad.jsonl:2") as caught:
        read_trace(path)
    assert message in str(caught.value) or message == "line"


def test_an_empty_trace_and_duplicate_ids_are_refused(tmp_path: Path) -> None:
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(TraceError, match="no requests"):
        read_trace(tmp_path / "empty.jsonl")
    line = '{"id": "a", "time": 0, "prompt": "x", "max_new_tokens": 3}\n'
    (tmp_path / "dup.jsonl").write_text(line * 2)
    with pytest.raises(TraceError, match="unique"):
        read_trace(tmp_path / "dup.jsonl")


def test_too_few_adapters_for_the_workload_is_an_error() -> None:
    with pytest.raises(TraceError, match="needs 24 adapters, 3 given"):
        make_trace(WorkloadSpec(), ADAPTERS[:3])


def test_percentiles_interpolate_between_ranks() -> None:
    assert percentile([], 50) is None
    assert percentile([4.0], 5) == 4.0
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 50) == 3.0
    assert percentile([10.0, 0.0], 5) == pytest.approx(0.5)


IDS = [f"a-{i:02d}" for i in range(24)]


def test_the_uniform_scenario_asks_every_adapter_alike() -> None:
    trace = make_trace(WorkloadSpec(scenario="uniform", requests=2400), IDS)
    counts = Counter(r.adapter_id for r in trace)
    assert set(counts) == set(IDS) and max(counts.values()) < 2 * min(counts.values())
    zipf = Counter(r.adapter_id for r in make_trace(WorkloadSpec(requests=2400), IDS))
    assert zipf["a-00"] > 5 * zipf["a-23"]  # the default stays skewed


def test_the_burst_scenario_brings_a_cold_tenant_with_12_unused_adapters_at_once() -> None:
    trace = make_trace(WorkloadSpec(scenario="burst", requests=64), IDS)
    assert len(trace) == 64
    newcomer = [r for r in trace if r.tenant == "t6"]  # a seventh tenant, after the 6
    assert len(newcomer) == 12 and newcomer[-1].time - newcomer[0].time < 0.2
    arrived = newcomer[0].time
    before = {r.adapter_id for r in trace if r.time < arrived}
    assert not {r.adapter_id for r in newcomer} & before, "its adapters were used before"
    assert len({r.adapter_id for r in newcomer}) == 12
    assert all(r.prompt.startswith("Tenant 6.") for r in newcomer)
    with pytest.raises(TraceError, match="more than 12 adapters"):
        make_trace(WorkloadSpec(scenario="burst", adapters=12), IDS)


def test_the_tenant_storm_floods_the_middle_third_with_one_tenant() -> None:
    trace = make_trace(WorkloadSpec(scenario="tenant-storm", requests=90), IDS)
    end = max(r.time for r in trace)
    middle = [r for r in trace if end / 3 <= r.time < 2 * end / 3]
    outside = [r for r in trace if not end / 3 <= r.time < 2 * end / 3]
    share = sum(r.tenant == "t0" for r in middle) / len(middle)
    assert share > 0.8 > sum(r.tenant == "t0" for r in outside) / len(outside) + 0.3
    assert all(r.adapter_id in IDS[::6] for r in middle if r.tenant == "t0")  # its own adapters
    assert [r.id for r in trace] == [f"r{n:04d}" for n in range(len(trace))]  # in time order


def test_an_unknown_scenario_is_refused() -> None:
    with pytest.raises(TraceError, match="unknown scenario 'storm'"):
        make_trace(WorkloadSpec(scenario="storm"), IDS)


def test_pressure_brings_200_adapters_8_tenants_and_a_hot_set_that_drifts() -> None:
    spec = SCENARIOS["pressure"].apply(WorkloadSpec(requests=3000, rate=2.0))
    ids = [f"demo-{i:03d}" for i in range(spec.adapters)]
    trace = make_trace(spec, ids)
    assert spec.adapters >= 200 and len({r.tenant for r in trace}) >= 8
    assert trace == make_trace(spec, ids)

    def top(start: float) -> set[str]:
        counts = Counter(r.adapter_id for r in trace if start <= r.time < start + 120)
        return {a for a, _ in counts.most_common(8)}

    # Zipf within a few minutes: the hottest adapter takes a large share...
    first = Counter(r.adapter_id for r in trace if r.time < 120)
    assert first.most_common(1)[0][1] / sum(first.values()) > 0.08
    # ... but the hot set of the first minutes is not the hot set of the last ones.
    assert len(top(0.0) & top(trace[-1].time - 120)) <= 5


def test_the_storm_trace_is_the_zipf_trace_plus_the_flood() -> None:
    spec = WorkloadSpec(requests=120, scenario="tenant-storm")
    storm = make_trace(spec, ADAPTERS)
    calm = make_trace(replace(spec, scenario="zipf"), ADAPTERS)

    def key(r: TraceRequest) -> tuple[object, ...]:
        return r.time, r.tenant, r.adapter_id, r.prompt

    calm_keys = {key(r) for r in calm}
    assert calm_keys <= {key(r) for r in storm}
    assert len(storm) > len(calm) and {r.tenant for r in storm if key(r) not in calm_keys} == {"t0"}
