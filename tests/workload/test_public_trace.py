"""The ``public`` scenario against the traces it is drawn from: arrivals per minute, lengths and
adapter popularity within 10% of the vendored sources, and the prefixes it says it shares."""

from __future__ import annotations

import argparse
from collections import Counter
from collections.abc import Sequence
from dataclasses import replace

import pytest

from lora_guard.workload.public import (
    PROMPT_MAX_WORDS,
    PROMPT_SCALE,
    PublicTrace,
    load_source,
    public_trace,
)
from lora_guard.workload.scenarios import SCENARIOS
from lora_guard.workload.stats import percentile
from lora_guard.workload.trace import (
    TraceError,
    WorkloadSpec,
    make_trace,
)

PUBLIC = SCENARIOS["public"]
ADAPTERS = [f"lora-{i:03d}" for i in range(int(PUBLIC.sets["adapters"]))]
SPEC = PUBLIC.apply(WorkloadSpec(output_mean=64.0, rate=3.0), requests=400)


@pytest.fixture(scope="module")
def whole() -> PublicTrace:
    """As many requests as the Azure trace holds: one pass over it, from seed 0's offset."""
    return public_trace(replace(SPEC, requests=len(load_source().times)), ADAPTERS)


def within(generated: Sequence[float], source: Sequence[float], tolerance: float = 0.10) -> None:
    for g, s in zip(generated, source, strict=True):
        assert abs(g - s) <= tolerance * s, (generated, source)


def quantiles(values: Sequence[float], points: Sequence[int] = (50, 90)) -> list[float]:
    return [percentile(values, p) or 0.0 for p in points]


def per_minute(times: Sequence[float], minute: float) -> list[int]:
    """Arrivals in each full ``minute`` from the first."""
    full = int((times[-1] - times[0]) // minute)
    counts = Counter(int((t - times[0]) // minute) for t in times)
    return [counts[m] for m in range(full)]


def top_shares(names: Sequence[object]) -> list[float]:
    counts = sorted(Counter(names).values(), reverse=True)
    return [sum(counts[:k]) / len(names) for k in (1, 5, 10, 20)]


def test_arrivals_are_the_azure_minutes_at_the_asked_mean_rate(whole: PublicTrace) -> None:
    times = [r.time for r in whole.requests]
    assert len(times) / times[-1] == pytest.approx(SPEC.rate, rel=0.01)
    # One minute of the Azure trace lasts time_scale minutes here.
    generated = per_minute(times, 60 * whole.plan.time_scale)
    source = per_minute(load_source().times, 60)
    assert len(generated) == len(source)
    within(quantiles(generated, (10, 50, 90)), quantiles(source, (10, 50, 90)))


def test_lengths_are_the_azure_lengths_scaled(whole: PublicTrace) -> None:
    source = load_source()
    prompts = [len(r.prompt.split()) for r in whole.requests]
    within(quantiles(prompts), [q * PROMPT_SCALE for q in quantiles(source.context_tokens)])
    assert max(prompts) <= PROMPT_MAX_WORDS
    outputs = [r.max_new_tokens for r in whole.requests]
    scale = whole.plan.output_scale
    within(quantiles(outputs), [q * scale for q in quantiles(source.generated_tokens)])
    assert sum(outputs) / len(outputs) == pytest.approx(SPEC.output_mean, rel=0.10)


def test_adapter_popularity_is_the_alibaba_lora_ranking(whole: PublicTrace) -> None:
    source = load_source()
    assert len(set(source.lora_ranks)) == PUBLIC.sets["adapters"]
    within(top_shares([r.adapter_id for r in whole.requests]), top_shares(source.lora_ranks))
    # The most requested LoRA of the trace is the first adapter given.
    assert Counter(r.adapter_id for r in whole.requests).most_common(1)[0][0] == ADAPTERS[0]


def test_tenants_take_the_busiest_servegen_clients_shares(whole: PublicTrace) -> None:
    rates = load_source().client_rates[: SPEC.tenants]
    counts = Counter(r.tenant for r in whole.requests)
    shares = [counts[f"t{t}"] / len(whole.requests) for t in range(SPEC.tenants)]
    within(shares, [rate / sum(rates) for rate in rates])
    owners: dict[str | None, set[str]] = {}
    for r in whole.requests:
        owners.setdefault(r.adapter_id, set()).add(r.tenant)
    assert all(len(tenants) == 1 for tenants in owners.values())


def test_a_later_turn_starts_with_the_earlier_turn(whole: PublicTrace) -> None:
    by_id = {r.id: r for r in whole.requests}
    assert len(whole.follows) > 0.15 * len(whole.requests)
    for later_id, earlier_id in whole.follows.items():
        later, earlier = by_id[later_id], by_id[earlier_id]
        assert later.prompt.startswith(earlier.prompt + " ")
        assert (later.adapter_id, later.tenant) == (earlier.adapter_id, earlier.tenant)
        assert earlier.time <= later.time


def test_a_tenants_requests_share_its_system_prompt(whole: PublicTrace) -> None:
    system: dict[str, set[str]] = {}
    for r in whole.requests:
        system.setdefault(r.tenant, set()).add(r.prompt.split("\n", 1)[0])
    assert len(system) == SPEC.tenants
    assert all(len(lines) == 1 for lines in system.values())
    assert len({line for lines in system.values() for line in lines}) == SPEC.tenants
    assert all(
        len(next(iter(lines)).split()) == SPEC.system_prompt_words + 2 for lines in system.values()
    )


def test_seeds_give_other_windows_and_a_seed_the_same_trace() -> None:
    traces = [make_trace(replace(SPEC, seed=seed), ADAPTERS) for seed in (0, 1, 2)]
    assert make_trace(SPEC, ADAPTERS) == traces[0]
    for i, a in enumerate(traces):
        for b in traces[i + 1 :]:
            assert [r.adapter_id for r in a] != [r.adapter_id for r in b]
            assert [r.max_new_tokens for r in a] != [r.max_new_tokens for r in b]


def test_fewer_adapters_take_the_loras_by_rank_modulo() -> None:
    trace = make_trace(replace(SPEC, adapters=24), ADAPTERS[:24])
    assert {r.adapter_id for r in trace} <= set(ADAPTERS[:24])


def test_bad_input_is_a_trace_error() -> None:
    with pytest.raises(TraceError, match="unknown scenario 'public-2'"):
        make_trace(replace(SPEC, scenario="public-2"), ADAPTERS)
    with pytest.raises(TraceError, match="needs 229 adapters, 24 given"):
        make_trace(SPEC, ADAPTERS[:24])
    with pytest.raises(TraceError, match="1 to 162 tenants"):
        make_trace(replace(SPEC, tenants=163), ADAPTERS)
    with pytest.raises(TraceError, match="positive rate"):
        make_trace(replace(SPEC, rate=0.0), ADAPTERS)


def test_virtual_time_runs_public_with_an_adapter_per_lora() -> None:
    from lora_guard.bench.virtual_time import _spec

    args = argparse.Namespace(
        adapters=None, tenants=None, requests=None, output_mean=64.0, scenario="public"
    )
    spec = _spec(args)
    assert (spec.scenario, spec.adapters, spec.tenants, spec.requests) == ("public", 229, 8, 1000)
    describe = PUBLIC.describe
    assert describe is not None  # what virtual time prints: the scales it used
    assert "GeneratedTokens x 0.303" in describe(replace(spec, rate=1.0))
