"""Several seeds, the compass and the load: figures combined the way the report says."""

from __future__ import annotations

import argparse

import pytest

from lora_guard.bench.arguments import add_arguments
from lora_guard.bench.capacity import Capacity, arrival_rate, mean_rate_factor
from lora_guard.bench.compass import compass, compass_lines
from lora_guard.bench.report import aggregate
from lora_guard.bench.run import replay_order
from lora_guard.workload.trace import WorkloadSpec, make_trace


def _scheme(**figures: object) -> dict[str, object]:
    base: dict[str, object] = {
        "requests": 10,
        "completed": 10,
        "kv_conflicts": 0,
        "oracle_mismatches": 0,
        "seeds": [0],
    }
    return base | figures


def test_counts_add_up_over_seeds_and_figures_are_medians_with_their_spread() -> None:
    seeds = [
        {"lora-guard": _scheme(tail_tokens_per_s=1.0, seeds=[0], cold_loads={"loaded": 1})},
        {"lora-guard": _scheme(tail_tokens_per_s=4.0, seeds=[1], cold_loads={"loaded": 2})},
        {"lora-guard": _scheme(tail_tokens_per_s=2.0, seeds=[2], cold_loads={"loaded": 6})},
    ]
    merged = aggregate(seeds)["lora-guard"]
    assert merged["requests"] == merged["completed"] == 30
    assert merged["tail_tokens_per_s"] == 2.0
    assert merged["spread"]["tail_tokens_per_s"] == [1.0, 4.0]
    assert merged["seeds"] == [0, 1, 2]
    assert merged["cold_loads"] == {"loaded": 2}  # a figure per seed: the median


def test_one_seed_is_reported_as_it_was() -> None:
    one = {"lru": _scheme(tail_tokens_per_s=3.5, ttft_p95_ms=None)}
    merged = aggregate([one])["lru"]
    assert {k: v for k, v in merged.items() if k != "spread"} == one["lru"]


def test_the_compass_divides_within_each_seed_before_taking_the_median() -> None:
    # Static is twice as fast in seed 0's run and as fast in seed 1's: the ratios are 0.5 and
    # 1.0, whatever the absolute speeds of the two runs (a ratio of medians would say 0.625).
    seeds = [
        {"static": _scheme(tail_tokens_per_s=8.0), "lora-guard": _scheme(tail_tokens_per_s=4.0)},
        {"static": _scheme(tail_tokens_per_s=2.0), "lora-guard": _scheme(tail_tokens_per_s=2.0)},
    ]
    tail = compass(seeds)["tail tok/s vs static"]
    assert tail["per_seed"] == [0.5, 1.0]
    assert tail["value"] == 0.75 and tail["spread"] == [0.5, 1.0]
    assert tail["met"] is False and tail["target"] == ">= 0.9"
    found = compass(seeds)
    assert found["kv conflicts"]["met"] is True
    assert "tok/s vs vllm" not in found  # no vllm run, nothing claimed
    lines = compass_lines(found, seeds=2)
    assert "lora-guard tail tok/s vs static: 0.75 (0.5-1, 2 seeds), target >= 0.9: missed" in lines
    assert "(0.5-1, 1 seed x 2 turns)" in compass_lines(found, seeds=1, turns=2)[0]


def test_each_replay_rotates_the_schemes_so_none_always_goes_first() -> None:
    assert replay_order(["static", "lora-guard"], 0) == ["static", "lora-guard"]
    assert replay_order(["static", "lora-guard"], 1) == ["lora-guard", "static"]
    three = ["static", "lora-guard", "lru"]
    orders = [replay_order(three, i) for i in range(3)]
    for position in range(3):
        assert sorted(order[position] for order in orders) == sorted(three)


def test_the_hit_rate_is_held_against_its_own_bound() -> None:
    seeds = [{"lora-guard": _scheme(hit_rate=0.45, hit_rate_bound=0.5, evictions=3)}]
    figure = compass(seeds)["hit rate vs its bound"]
    assert figure["value"] == pytest.approx(0.9) and figure["met"]


def test_a_run_set_built_to_miss_prints_missed_on_every_target() -> None:
    """Each target that can be judged fails a run set made to fail it: none is met by default."""
    static = _scheme(
        tail_tokens_per_s=10.0, ttft_p95_ms=100.0, peak_rss_mib=1000.0, peak_memory_mib=500.0
    )
    bad = _scheme(
        tail_tokens_per_s=5.0,
        ttft_p95_ms=500.0,
        peak_rss_mib=1200.0,
        peak_memory_mib=500.0,
        hit_rate=0.2,
        hit_rate_bound=0.8,
        evictions=9,
    )
    clean = bad | {"hit_rate": 0.8}
    # one run of three breaks the zero-tolerance counts: a median of (0, 1, 0) would say 0
    broken = clean | {"kv_conflicts": 1, "oracle_mismatches": 2}
    runs = [{"static": static, "lora-guard": one} for one in (broken, bad, bad)]
    found = compass(runs)
    judged = [
        "tail tok/s vs static",
        "TTFT p95 vs static",
        "peak RSS vs static",
        "hit rate vs its bound",
        "kv conflicts",
        "oracle mismatches",
    ]
    assert {name: found[name]["met"] for name in judged} == dict.fromkeys(judged, False)
    assert found["kv conflicts"]["value"] == 1 and found["oracle mismatches"]["value"] == 2
    assert found["peak RSS vs static"]["value"] == pytest.approx(1.2)
    lines = compass_lines(found, seeds=3)
    for name in judged:
        assert any(
            line.startswith(f"lora-guard {name}:") and line.endswith(": missed") for line in lines
        ), name


def test_targets_a_run_set_cannot_tell_say_why_instead_of_met() -> None:
    same = _scheme(
        tokens_per_s=40.0, peak_memory_mib=500.0, hit_rate=1.0, hit_rate_bound=1.0, evictions=0
    )
    peer = _scheme(tokens_per_s=4.0)
    found = compass([{"static": same, "lora-guard": same, "peft": peer, "vllm": peer}])
    hit = found["hit rate vs its bound"]
    assert hit["met"] is None and "evicted no adapter" in hit["note"]
    for name in ("tok/s vs peft", "tok/s vs vllm"):  # 10x, but a makespan is no capacity
        assert found[name]["value"] == 10 and found[name]["met"] is None
        assert "capacity" in found[name]["note"]
    assert found["pool memory vs static"]["met"] is None  # the same pool for all: reported only
    lines = compass_lines(found, seeds=1)
    assert not any(
        line.endswith(": met") for line in lines if "hit rate" in line or "tok/s" in line
    )
    assert "lora-guard pool memory vs static: 1, target reported: reported" in lines


def test_the_load_sets_the_mean_arrival_rate_to_a_share_of_capacity() -> None:
    spec = WorkloadSpec(requests=4000, seed=3)
    capacity = Capacity(requests_per_s=2.0, tokens_per_s=360.0, batch=16, mean_new_tokens=180)
    rate = arrival_rate(spec, 0.5, capacity)
    assert mean_rate_factor(spec) == pytest.approx(1.6)  # 4x arrivals for 4 s out of every 20
    trace = make_trace(
        WorkloadSpec(requests=4000, seed=3, rate=rate), ["a", *"bcdefghijklmnopqrstuvwx"]
    )
    mean = len(trace) / trace[-1].time
    assert mean == pytest.approx(0.5 * capacity.requests_per_s, rel=0.1)


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv)


def test_seeds_are_read_as_a_list_and_seed_is_one_of_them() -> None:
    assert _parse("--seeds", "0,1,2").seeds == [0, 1, 2]
    assert _parse("--seed", "7").seeds == [7]
    assert _parse().seeds is None and _parse().load == 0.7 and _parse().requests == 200
    for bad in ("1,x", "1,1", ","):
        with pytest.raises(SystemExit):
            _parse("--seeds", bad)


def test_peers_are_a_list_of_vllm_alone_and_vllm_with_lora_guard() -> None:
    assert _parse().peer == ()
    assert _parse("--peer", "vllm").peer == ("vllm",)
    assert _parse("--peer", "vllm,vllm-lora-guard").peer == ("vllm", "vllm-lora-guard")
    assert _parse("--peer", "vllm-all-resident").peer == ("vllm-all-resident",)
    for bad in ("llama", "vllm,x", ","):
        with pytest.raises(SystemExit):
            _parse("--peer", bad)
