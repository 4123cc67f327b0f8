"""The workload scenarios, one :class:`Scenario` each in :data:`SCENARIOS`.

A scenario is data over one generator (``trace.make_trace`` with ``draw.Draw``): the spec fields
it sets, how popular each adapter is and whether that drifts, what it does to the drawn arrivals
(``reshape``), or a generator of its own (``public``); and what a study needs to know of it: how
many requests and output tokens it runs by default, whether the pool is sized by the load, which
adapters it serves, and the same trace without its event. A new scenario is one entry here (and
its reshape, where it changes the arrivals).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from lora_guard.workload.draw import Arrival, Draw
from lora_guard.workload.spec import TraceError, TraceRequest, WorkloadSpec

BURST_ADAPTERS = 12  # adapters the cold tenant of the ``burst`` scenario brings at once
STORM_FACTOR = 8.0  # the flooding tenant's arrival rate over everyone else's, in ``tenant-storm``


def new_tenant_burst(draw: Draw, arrivals: list[Arrival]) -> None:
    """Halfway through, a new tenant sends one request for each of its :data:`BURST_ADAPTERS`
    adapters (the last ones, unused until then), 10 ms apart, in place of as many of the
    arrivals that follow (the trace's length stays as asked)."""
    tenant = draw.add_tenant()
    middle = len(arrivals) // 2
    start = arrivals[middle].time
    del arrivals[middle : middle + BURST_ADAPTERS]
    first = len(draw.weights) - BURST_ADAPTERS
    arrivals += [draw.request(start + 0.01 * k, tenant, first + k) for k in range(BURST_ADAPTERS)]


def tenant_storm(draw: Draw, arrivals: list[Arrival]) -> None:
    """Over the middle third, tenant 0 adds :data:`STORM_FACTOR` times the other tenants'
    arrivals there, on its own adapters (the trace grows by the flood)."""
    low, high = arrivals[-1].time / 3, 2 * arrivals[-1].time / 3
    own = [i for i in range(len(draw.weights)) if i % draw.spec.tenants == 0]
    others = sum(1 for a in arrivals if low <= a.time < high and a.tenant != 0)
    for _ in range(round(STORM_FACTOR * max(others, 1))):
        index = draw.rng.choices(own, weights=[draw.weights[i] for i in own])[0]
        arrivals.append(draw.request(draw.rng.uniform(low, high), 0, index))


def _public(spec: WorkloadSpec, adapter_ids: Sequence[str]) -> list[TraceRequest]:
    from lora_guard.workload.public import public_trace

    return public_trace(spec, adapter_ids).requests


def _public_plan(spec: WorkloadSpec) -> str:
    from lora_guard.workload.public import plan

    return plan(spec).describe()


@dataclass(frozen=True)
class Scenario:
    """One workload scenario.

    :param sets: the spec fields it changes (:meth:`apply`; the settings a user names win).
    :param even: every adapter as popular (else Zipf over the spec's ``zipf``).
    :param drift: the popularity ranking drifts (the spec's ``drift_every_s``, ``hot_ranks``,
        ``drift_share``).
    :param reserved: adapters, the last ones, the draw leaves unused for ``reshape``.
    :param reshape: changes the drawn arrivals.
    :param generate: makes the trace itself, in place of the draw.
    :param describe: a line on how the trace was made from ``spec`` (its rate set).
    :param requests: requests a seed in virtual time by default.
    :param output_mean: mean output tokens in virtual time by default.
    :param sized_pool: studies size the pool by the load (the adapters in use over a minute
        several times the room beside the KV), not by the profile's memory.
    :param mixed_adapters: its adapters are of mixed ranks and targets (virtual time's
        ``PRESSURE_RANKS``), else of ``ranks`` on every projection.
    :param calm: the scenario that is this one without its event, which studies replay beside
        it to compare each tenant against.
    """

    name: str
    about: str
    sets: Mapping[str, object] = field(default_factory=dict)
    even: bool = False
    drift: bool = False
    reserved: int = 0
    reshape: Callable[[Draw, list[Arrival]], None] | None = None
    generate: Callable[[WorkloadSpec, Sequence[str]], list[TraceRequest]] | None = None
    describe: Callable[[WorkloadSpec], str] | None = None
    requests: int = 200
    output_mean: float = 64.0
    sized_pool: bool = False
    mixed_adapters: bool = False
    ranks: tuple[int, ...] = (4, 8, 16)
    calm: str | None = None

    def apply(self, spec: WorkloadSpec, **given: object) -> WorkloadSpec:
        """``spec`` as this scenario runs it: :attr:`sets` where ``given`` (the settings a user
        named) does not say otherwise."""
        return replace(spec, scenario=self.name, **{**self.sets, **given})  # type: ignore[arg-type]

    def check(self, spec: WorkloadSpec, adapter_ids: Sequence[str]) -> None:
        if len(adapter_ids) < spec.adapters:
            raise TraceError(
                f"the workload needs {spec.adapters} adapters, {len(adapter_ids)} given"
            )
        if self.reserved and spec.adapters <= self.reserved:
            raise TraceError(f"the {self.name} scenario needs more than {self.reserved} adapters")


SCENARIOS: dict[str, Scenario] = {
    s.name: s
    for s in (
        Scenario("zipf", "Zipf popularity over the adapters, each tenant its own"),
        Scenario("uniform", "every adapter as popular", even=True),
        Scenario(
            "burst",
            f"halfway through, a new tenant sends one request for each of its {BURST_ADAPTERS} "
            "adapters, which nobody used before, at once",
            reserved=BURST_ADAPTERS,
            reshape=new_tenant_burst,
        ),
        Scenario(
            "tenant-storm",
            f"over the middle third, tenant t0 adds {STORM_FACTOR:g}x the others' traffic on its "
            "own adapters",
            reshape=tenant_storm,
            calm="zipf",
        ),
        Scenario(
            "pressure",
            "200 adapters of mixed ranks, 8 tenants, drifting Zipf popularity",
            sets={"adapters": 200, "tenants": 8},
            drift=True,
            requests=1000,
            sized_pool=True,
            mixed_adapters=True,
        ),
        Scenario(
            "public",
            "arrivals and lengths from Azure's LLM inference trace, the order of 229 LoRAs from "
            "Alibaba's, 8 tenants from ServeGen's clients (docs/workloads.md)",
            # an adapter for each LoRA of the Alibaba trace, a shorter system prompt (256 tokens
            # at the prompt scale), and no bursts of the spec's own (the trace brings its own,
            # so the rate is the mean rate)
            sets={"adapters": 229, "tenants": 8, "system_prompt_words": 32, "burst_factor": 1.0},
            generate=_public,
            describe=_public_plan,
            requests=1000,
            sized_pool=True,
            mixed_adapters=True,
        ),
        Scenario(
            "seed",
            "zipf in the article's setting: 24 adapters of ranks 8-32, 180 output tokens on "
            "average",
            output_mean=180.0,
            ranks=(8, 16, 32),
        ),
    )
}


def scenario(name: str) -> Scenario:
    try:
        return SCENARIOS[name]
    except KeyError:
        raise TraceError(f"unknown scenario {name!r}; choose from {', '.join(SCENARIOS)}") from None
