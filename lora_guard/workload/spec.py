"""The workload's vocabulary: what a trace generator draws from (:class:`WorkloadSpec`), what it
makes (:class:`TraceRequest`), its error, and the words made-up prompts are written in. Every
generator (``trace.py``, ``public.py``) builds on these."""

from __future__ import annotations

import random
from dataclasses import dataclass

_WORD_LIST = (
    "river stone lantern market harbour ledger orchard signal copper winter garden railway "
    "letter mountain engine window meadow compass archive bridge candle forest island "
    "journey kettle ladder mirror needle ocean pencil quarry ribbon saddle timber valley"
)
_WORDS = _WORD_LIST.split()
#: every word a made-up prompt is built of: a model trained to tokenize like a real model's
#: tokenizer learns these whole (``make_tiny_tokenizer``'s ``words``)
PROMPT_WORDS = (*_WORDS, "Tenant", "User:", "Question:", "Assistant:", "Request:", "Sure.")


class TraceError(ValueError):
    """A trace line cannot be read."""


@dataclass(frozen=True)
class WorkloadSpec:
    """What the generator draws from. Times in seconds, lengths in words (about one token
    each) and tokens."""

    adapters: int = 24
    tenants: int = 6
    requests: int = 32
    rate: float = 0.25  # mean arrivals per second outside bursts
    burst_every_s: float = 20.0
    burst_len_s: float = 4.0
    burst_factor: float = 4.0  # arrival rate multiplier inside a burst
    zipf: float = 1.0
    system_prompt_words: int = 64  # shared by every request of a tenant
    user_words_mean: float = 24.0
    output_mean: float = 180.0
    output_min: int = 16
    output_max: int = 400
    base_share: float = 0.0  # share of requests for the base model (no adapter)
    seed: int = 0
    # zipf: popularity 1/(i+1)**zipf; uniform: every adapter alike; burst: halfway through, a new
    # tenant arrives with 12 adapters nobody used before, one request each at once; tenant-storm:
    # over the middle third, tenant t0 adds 8x the rest's traffic on its own adapters; pressure:
    # zipf whose ranking drifts (every drift_every_s, each of the hot_ranks most popular places
    # is handed, with chance drift_share, to an adapter drawn from the rest); public: arrivals,
    # lengths, adapter order and tenants from public traces (workload/public.py); seed: zipf
    # in the article's setting (24 adapters, 180 output tokens on average, virtual time's).
    scenario: str = "zipf"
    drift_every_s: float = 60.0
    drift_share: float = 0.25
    hot_ranks: int = 16


def mean_rate(spec: WorkloadSpec) -> float:
    """Mean arrivals per second of ``spec``'s trace, its bursts counted (about: a burst's
    start is checked at each arrival)."""
    share = spec.burst_len_s / spec.burst_every_s
    return spec.rate * (1 + (spec.burst_factor - 1) * share)


@dataclass(frozen=True)
class TraceRequest:
    id: str
    time: float
    tenant: str
    adapter_id: str | None
    prompt: str
    max_new_tokens: int


def _words(rng: random.Random, n: int, lead: str) -> str:
    return " ".join([lead, *rng.choices(_WORDS, k=n)])
