"""The draws every generated trace is made of, in one order, so that a seed gives one trace.

:class:`Draw` holds a trace's random source, its tenants' system prompts and the adapters'
popularity weights, and makes arrivals: Poisson times with the spec's bursts, an adapter by
popularity (its ranking drifting where the scenario says), a tenant's prompt and a lognormal
output length. A scenario's ``reshape`` (``scenarios.py``) then changes the arrivals with the
same draws.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from lora_guard.workload.spec import WorkloadSpec, _words

OUTPUT_SIGMA = 0.6  # of the lognormal output lengths: a long tail


@dataclass(frozen=True)
class Arrival:
    time: float
    tenant: int
    index: int | None  # into the adapters; None for the base model
    prompt: str
    max_new_tokens: int


class Draw:
    """One trace's draws: adapter ``i`` has Zipf weight ``1/(i+1)**spec.zipf`` (every adapter 1
    where ``even``; the last ``reserved`` 0, kept for a reshape) and belongs to tenant
    ``i % spec.tenants``; each tenant has its own system prompt."""

    def __init__(self, spec: WorkloadSpec, adapters: int, even: bool, reserved: int) -> None:
        self.spec = spec
        self.rng = random.Random(spec.seed)
        exponent = 0.0 if even else spec.zipf
        self.weights = [1 / (i + 1) ** exponent for i in range(adapters)]
        if reserved:
            self.weights[-reserved:] = [0.0] * reserved
        self.system = [
            _words(self.rng, spec.system_prompt_words, f"Tenant {t}.") for t in range(spec.tenants)
        ]
        self._mu = math.log(spec.output_mean) - OUTPUT_SIGMA**2 / 2

    def request(self, time: float, tenant: int, index: int | None) -> Arrival:
        """An arrival at ``time`` of ``tenant`` for adapter ``index``: the tenant's system prompt,
        a user turn and an output length drawn now."""
        spec, rng = self.spec, self.rng
        user_words = max(1, round(rng.expovariate(1 / spec.user_words_mean)))
        prompt = f"{self.system[tenant]}\nUser: {_words(rng, user_words, 'Question:')}\nAssistant:"
        out = round(rng.lognormvariate(self._mu, OUTPUT_SIGMA))
        return Arrival(time, tenant, index, prompt, min(spec.output_max, max(spec.output_min, out)))

    def add_tenant(self) -> int:
        """A tenant the spec does not have, with a system prompt of its own; its number."""
        tenant = len(self.system)
        self.system.append(_words(self.rng, self.spec.system_prompt_words, f"Tenant {tenant}."))
        return tenant

    def arrivals(self, drift: bool) -> list[Arrival]:
        """``spec.requests`` arrivals; with ``drift``, the popularity ranking drifts every
        ``spec.drift_every_s``."""
        spec, rng = self.spec, self.rng
        ranking = list(range(len(self.weights)))  # popularity place -> adapter index
        places = range(len(ranking))
        out: list[Arrival] = []
        now, next_drift = 0.0, spec.drift_every_s
        for _ in range(spec.requests):
            in_burst = (now % spec.burst_every_s) < spec.burst_len_s
            now += rng.expovariate(spec.rate * (spec.burst_factor if in_burst else 1.0))
            while drift and now >= next_drift:
                self._drift(ranking)
                next_drift += spec.drift_every_s
            if rng.random() < spec.base_share:
                out.append(self.request(now, rng.randrange(spec.tenants), None))
            else:
                index = ranking[rng.choices(places, weights=self.weights)[0]]
                out.append(self.request(now, index % spec.tenants, index))
        return out

    def _drift(self, ranking: list[int]) -> None:
        """Hand some of the most popular places to adapters from the rest of the ranking."""
        spec = self.spec
        hot = min(spec.hot_ranks, len(ranking) - 1)
        for place in range(hot):
            if self.rng.random() < spec.drift_share:
                other = self.rng.randrange(hot, len(ranking))
                ranking[place], ranking[other] = ranking[other], ranking[place]
