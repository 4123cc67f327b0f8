"""Sampling parameters (TGI's names) and the sampler that turns logits into next tokens."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

# A temperature this small is greedy decoding; dividing by it would overflow the logits.
GREEDY_BELOW = 1e-5


class InvalidParams(ValueError):
    """A sampling parameter is out of range; the message uses TGI's wording."""


@dataclass(slots=True)
class SamplingParams:
    """How one request picks its tokens.

    Greedy unless ``do_sample`` is set or a warper (``temperature`` other than 1, ``top_k``,
    ``top_p`` below 1) is given, as in TGI. ``seed`` makes sampling reproducible per request,
    whatever else shares the batch.
    """

    max_new_tokens: int = 20
    do_sample: bool = False
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    repetition_penalty: float | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0  # no end of sequence (EOS or ``stop_token_ids``) before this many tokens
    stop_token_ids: list[int] = field(default_factory=list)  # generating one ends the request
    skip_special_tokens: bool = True  # in the text; the token ids keep them

    def __post_init__(self) -> None:
        for name in ("temperature", "top_p", "repetition_penalty"):
            value = getattr(self, name)
            if value is not None and not math.isfinite(value):
                raise InvalidParams(f"`{name}` must be a finite number")
        if self.max_new_tokens < 1:
            raise InvalidParams("`max_new_tokens` must be strictly positive")
        if self.temperature is not None and self.temperature <= 0:
            raise InvalidParams("`temperature` must be strictly positive")
        if self.top_k is not None and self.top_k <= 0:
            raise InvalidParams("`top_k` must be strictly positive")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise InvalidParams("`top_p` must be > 0.0 and <= 1.0")
        if self.repetition_penalty is not None and self.repetition_penalty <= 0:
            raise InvalidParams("`repetition_penalty` must be strictly positive")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise InvalidParams("`seed` must be a non-negative 64-bit integer")
        if any(not s for s in self.stop):
            raise InvalidParams("`stop` sequences must not be empty")
        if not 0 <= self.min_tokens <= self.max_new_tokens:
            raise InvalidParams("`min_tokens` must be >= 0 and <= `max_new_tokens`")
        if any(t < 0 for t in self.stop_token_ids):
            raise InvalidParams("`stop_token_ids` must be token ids (>= 0)")

    @property
    def sampling(self) -> bool:
        warped = (
            (self.temperature is not None and self.temperature != 1.0)
            or self.top_k is not None
            or (self.top_p is not None and self.top_p < 1.0)
        )
        return self.do_sample or warped


@dataclass(slots=True)
class SamplerInput:
    """One row of logits to sample from and what the sampler needs to know about its request."""

    params: SamplingParams
    generator: torch.Generator | None
    history: list[int]  # prompt and generated tokens, for the repetition penalty
    banned: tuple[int, ...] = ()  # tokens it may not pick now (the ends, before ``min_tokens``)


def sample(logits: torch.Tensor, rows: list[SamplerInput]) -> tuple[list[int], list[float]]:
    """Pick one token per row of ``logits`` ([n, vocab], any float dtype).

    Returns the tokens and their log-probabilities under the processed distribution.
    """
    logits = logits.float()
    if any(r.banned for r in rows):
        logits = logits.clone()
        for i, r in enumerate(rows):
            ids = [t for t in r.banned if t < logits.shape[1]]
            logits[i, ids] = float("-inf")
    if all(not r.params.sampling and not r.params.repetition_penalty for r in rows):
        logprobs = torch.log_softmax(logits, dim=-1)
        tokens = logits.max(dim=-1).indices  # the first largest, as argmax, in half its time
        chosen = logprobs.gather(1, tokens[:, None]).squeeze(1)
        return tokens.tolist(), chosen.tolist()
    out_tokens, out_logprobs = [], []
    for row, inp in zip(logits, rows, strict=True):
        token, logprob = _sample_row(row, inp)
        out_tokens.append(token)
        out_logprobs.append(logprob)
    return out_tokens, out_logprobs


def _sample_row(logits: torch.Tensor, inp: SamplerInput) -> tuple[int, float]:
    p = inp.params
    if p.repetition_penalty and p.repetition_penalty != 1.0 and inp.history:
        seen = torch.tensor(sorted(set(inp.history)), device=logits.device)
        scores = logits[seen]
        logits = logits.clone()
        logits[seen] = torch.where(
            scores > 0, scores / p.repetition_penalty, scores * p.repetition_penalty
        )
    if not p.sampling or (p.temperature is not None and p.temperature < GREEDY_BELOW):
        token = int(logits.argmax())
        return token, float(torch.log_softmax(logits, dim=-1)[token])
    if p.temperature is not None and p.temperature != 1.0:
        logits = logits / p.temperature
    if p.top_k is not None and p.top_k < logits.numel():
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if p.top_p is not None and p.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
        drop = cumulative - torch.softmax(sorted_logits, dim=-1) >= p.top_p
        logits = logits.masked_fill(drop.scatter(0, order, drop), float("-inf"))
    logprobs = torch.log_softmax(logits, dim=-1)
    token = int(torch.multinomial(logprobs.exp(), 1, generator=inp.generator))
    return token, float(logprobs[token])
