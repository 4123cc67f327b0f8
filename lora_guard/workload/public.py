"""The ``public`` scenario: a trace drawn from public production traces (docs/workloads.md).

- Arrivals and lengths: the Azure LLM inference trace 2023, conversation service. A seeded window
  of consecutive requests (wrapping round the hour), its times stretched or compressed by one
  factor so its mean rate is the spec's; prompts are ``ContextTokens`` x :data:`PROMPT_SCALE` words,
  outputs ``GeneratedTokens`` x ``output_mean`` / the trace's mean output.
- Adapters: the order of LoRA use of one base model in Alibaba's GenAI trace (a seeded window,
  wrapping); the i-th adapter request takes the i-th LoRA, ``adapter_ids[rank]``.
- Tenants: the busiest ServeGen ``m-large`` clients; adapters are dealt to tenants so each tenant's
  share of the requests follows its client's share of the rate.
- Prefixes: a tenant's requests share its system prompt; with :data:`CONTINUE_SHARE` a request
  continues one of its adapter's recent conversations (its prompt: that conversation's last prompt,
  the answer, then new words) where its ``ContextTokens`` leave room for it.
"""

from __future__ import annotations

import csv
import gzip
import random
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from lora_guard.workload.spec import TraceError, TraceRequest, WorkloadSpec, _words, mean_rate

DATA = Path(__file__).resolve().with_name("public_data")
PROMPT_SCALE = 0.125  # prompt words per context token of the Azure trace
PROMPT_MAX_WORDS = 640  # longer prompts are cut to this (about the longest 0.5%)
CONTINUE_SHARE = 0.5  # chance a request continues a recent conversation of its adapter
RECENT_CONVERSATIONS = 4  # conversations per adapter a request may continue


@dataclass(frozen=True)
class Source:
    """The vendored traces."""

    times: tuple[float, ...]  # Azure conv: seconds from its first request
    context_tokens: tuple[int, ...]
    generated_tokens: tuple[int, ...]
    lora_ranks: tuple[int, ...]  # Alibaba: each LoRA request's adapter, by popularity rank
    client_rates: tuple[float, ...]  # ServeGen m-large: each client's mean rate, busiest first

    @property
    def period(self) -> float:
        """The Azure window's length when it wraps: its span and one mean gap."""
        return (self.times[-1] - self.times[0]) * len(self.times) / (len(self.times) - 1)

    def time_at(self, position: int) -> float:
        """Arrival time of request ``position`` of the Azure trace repeated end to end."""
        turn, index = divmod(position, len(self.times))
        return self.times[index] + turn * self.period

    @property
    def mean_output(self) -> float:
        return sum(self.generated_tokens) / len(self.generated_tokens)


@cache
def load_source() -> Source:
    azure = _rows("azure_conv.csv.gz")
    return Source(
        times=tuple(int(r["ms"]) / 1000 for r in azure),
        context_tokens=tuple(int(r["context_tokens"]) for r in azure),
        generated_tokens=tuple(int(r["generated_tokens"]) for r in azure),
        lora_ranks=tuple(int(r["adapter_rank"]) for r in _rows("alibaba_lora.csv.gz")),
        client_rates=tuple(float(r["mean_rate"]) for r in _rows("servegen_m_large.csv")),
    )


def _rows(name: str) -> list[dict[str, str]]:
    path = DATA / name
    if not path.is_file():
        raise TraceError(f"the public traces are missing ({path}); reinstall lora-guard")
    opener = gzip.open if name.endswith(".gz") else open
    with opener(path, "rt", newline="") as f:
        return list(csv.DictReader(f))


@dataclass(frozen=True)
class Plan:
    """How one trace maps the sources: where its windows start, and the scales."""

    azure_offset: int
    lora_offset: int
    time_scale: float  # trace seconds per second of the Azure trace
    output_scale: float  # max_new_tokens per generated token of the Azure trace
    loras: int  # distinct LoRAs of the Alibaba trace
    adapters: int  # adapters they fall on (rank modulo adapters)

    def describe(self) -> str:
        return (
            f"{scales_line(self.output_scale)}; time x {self.time_scale:.3g}; "
            f"{self.loras} LoRAs on {self.adapters} adapters"
        )


def scales_line(output_scale: float) -> str:
    """The length scales, as a user reads them."""
    return (
        f"prompts: Azure ContextTokens x {PROMPT_SCALE:g} words (at most {PROMPT_MAX_WORDS}); "
        f"outputs: GeneratedTokens x {output_scale:.3g} tokens"
    )


def output_scale(spec: WorkloadSpec) -> float:
    return spec.output_mean / load_source().mean_output


def plan(spec: WorkloadSpec) -> Plan:
    source = load_source()
    rng = random.Random(f"public-{spec.seed}")
    start = rng.randrange(len(source.times))
    before, last = source.time_at(start - 1), source.time_at(start + spec.requests - 1)
    span = max(last - before, 0.001)  # requests a millisecond apart may share a time stamp
    time_scale = spec.requests / (mean_rate(spec) * span)
    lora_offset = rng.randrange(len(source.lora_ranks))
    loras = len(set(source.lora_ranks))
    return Plan(start, lora_offset, time_scale, output_scale(spec), loras, spec.adapters)


@dataclass(frozen=True)
class PublicTrace:
    requests: list[TraceRequest]
    follows: dict[str, str]  # request id -> id of the conversation's previous turn
    plan: Plan


@dataclass
class _Conversation:
    prompt: str
    words: int
    answer_words: int  # the last turn's answer as it reads in the next prompt
    last_id: str


def public_trace(spec: WorkloadSpec, adapter_ids: Sequence[str]) -> PublicTrace:
    """The ``public`` trace for ``spec`` (its ``requests``, ``adapters``, ``tenants``, ``seed``,
    ``output_mean``, ``system_prompt_words``, ``base_share``; its mean rate ``mean_rate(spec)``).
    Popularity ranks past ``spec.adapters`` fold onto ``adapter_ids`` (rank modulo adapters)."""
    source = load_source()
    if spec.requests < 1 or spec.adapters < 1 or not 1 <= spec.tenants <= len(source.client_rates):
        raise TraceError(
            "the public scenario needs a request, an adapter and 1 to "
            f"{len(source.client_rates)} tenants (one per ServeGen client)"
        )
    if mean_rate(spec) <= 0:
        raise TraceError(f"the public scenario needs a positive rate, got {spec.rate}")
    the_plan = plan(spec)
    rng = random.Random(spec.seed)
    owner = _owners(source, spec)
    system = [_words(rng, spec.system_prompt_words, f"Tenant {t}.") for t in range(spec.tenants)]
    tenant_weights = source.client_rates[: spec.tenants]
    recent: dict[int | None, deque[_Conversation]] = {}
    requests: list[TraceRequest] = []
    follows: dict[str, str] = {}
    start_time = source.time_at(the_plan.azure_offset - 1)
    lora_requests = 0
    for n in range(spec.requests):
        position = the_plan.azure_offset + n
        index = position % len(source.times)
        request_id = f"r{n:04d}"
        adapter: int | None = None
        if rng.random() < spec.base_share:
            tenant = rng.choices(range(len(tenant_weights)), weights=tenant_weights)[0]
        else:
            rank = _lora_rank(source, the_plan.lora_offset + lora_requests)
            adapter, lora_requests = rank % spec.adapters, lora_requests + 1
            tenant = owner[adapter]
        words = min(PROMPT_MAX_WORDS, round(source.context_tokens[index] * PROMPT_SCALE))
        generated = source.generated_tokens[index]
        out = round(generated * the_plan.output_scale)
        conversations = recent.setdefault(adapter, deque(maxlen=RECENT_CONVERSATIONS))
        room = [c for c in conversations if c.words + c.answer_words + 4 <= words]
        if room and rng.random() < CONTINUE_SHARE:
            conversation = rng.choice(room)
            answer = _words(rng, conversation.answer_words - 1, "Sure.")
            head = f"{conversation.prompt} {answer}"
            used = conversation.words + conversation.answer_words
            follows[request_id] = conversation.last_id
            conversations.remove(conversation)
        else:
            head, used = system[tenant], spec.system_prompt_words + 2
        # "User:", the question's lead word and "Assistant:" are words of the prompt too
        prompt = f"{head}\nUser: {_words(rng, max(1, words - used - 3), 'Question:')}\nAssistant:"
        answer_words = max(2, round(generated * PROMPT_SCALE))
        conversations.append(_Conversation(prompt, len(prompt.split()), answer_words, request_id))
        requests.append(
            TraceRequest(
                id=request_id,
                time=round((source.time_at(position) - start_time) * the_plan.time_scale, 3),
                tenant=f"t{tenant}",
                adapter_id=adapter_ids[adapter] if adapter is not None else None,
                prompt=prompt,
                max_new_tokens=min(spec.output_max, max(spec.output_min, out)),
            )
        )
    return PublicTrace(requests, follows, the_plan)


def _lora_rank(source: Source, position: int) -> int:
    return source.lora_ranks[position % len(source.lora_ranks)]


def _owners(source: Source, spec: WorkloadSpec) -> list[int]:
    """Each adapter's tenant: adapters, most requested first, each dealt to the tenant furthest
    below its client's share of the requests."""
    weights = source.client_rates[: spec.tenants]
    tenants = len(weights)
    requests = [0] * spec.adapters
    for rank in source.lora_ranks:
        requests[rank % spec.adapters] += 1
    total, given = sum(requests), [0.0] * tenants
    owner = [0] * spec.adapters
    for adapter in sorted(range(spec.adapters), key=lambda a: -requests[a]):
        tenant = max(range(tenants), key=lambda t: weights[t] / sum(weights) * total - given[t])
        owner[adapter], given[tenant] = tenant, given[tenant] + requests[adapter]
    return owner
