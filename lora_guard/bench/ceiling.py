"""How close a throughput is to the machine: the work a generated token costs, counted in FLOPs,
against the machine's own matrix rate measured beside the point.

A generated token costs a forward pass of one token at its context: every linear layer's weights
(two FLOPs a weight: a multiply and an add), the LM head, attention over the positions before it,
and its adapter's A and B on each projection it targets. Prompt tokens are not counted (a prompt
found in the prefix cache costs nothing, one prefilled costs as much again), so the share is a
floor on the work the server did. Norms, rotary embeddings and sampling are left out: they are a
few percent of the FLOPs and no matrix product.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from lora_guard.bench.machine_speed import machine_speed
from lora_guard.cost_profiles import Shape
from lora_guard.engine.lora.checkpoint import layer_elements
from lora_guard.engine.spec import LORA_TARGETS
from lora_guard.workload.trace import TraceRequest


@dataclass(frozen=True)
class TokenWork:
    """What a generated token of a model costs, in FLOPs, beside its adapter's."""

    shape: Shape
    vocab: int
    head_dim: int
    lora_params: dict[str, int]  # adapter -> weights in its A and B matrices (file header)

    @classmethod
    def of(cls, model: Path, adapter_dir: Path | None, adapters: Sequence[str]) -> TokenWork:
        config = json.loads((model / "config.json").read_text())
        shape = Shape.of_checkpoint(model)
        head_dim = config.get("head_dim") or shape.hidden // shape.heads
        params = {
            a: sum(sum(ab) for ab in layer_elements(adapter_dir / a).values())
            for a in adapters
            if adapter_dir is not None
        }
        return cls(shape, config["vocab_size"], head_dim, params)

    def flops(self, context: float, adapter: str | None = None) -> float:
        """FLOPs of one token's forward pass after ``context`` positions, with ``adapter``."""
        s = self.shape
        weights = s.layers * sum(i * o for i, o in map(s.projection, LORA_TARGETS))
        weights += s.hidden * self.vocab  # the LM head
        attention = 2 * s.layers * s.heads * self.head_dim * context  # scores, weighted sum
        lora = self.lora_params.get(adapter, 0) if adapter is not None else 0
        return 2.0 * (weights + attention + lora)

    def mean_flops(self, trace: Sequence[TraceRequest], prompt_tokens: Sequence[int]) -> float:
        """FLOPs of a generated token of ``trace``, averaged over its tokens: each request's at
        its mean context (its prompt, ``prompt_tokens``, and half its output) and adapter."""
        total = tokens = 0.0
        for request, prompt in zip(trace, prompt_tokens, strict=True):
            n = request.max_new_tokens
            total += n * self.flops(prompt + n / 2, request.adapter_id)
            tokens += n
        return total / tokens if tokens else 0.0


def machine_share(
    tokens_per_s: float, flops_per_token: float, gflops: float | None
) -> float | None:
    """The share of the machine's matrix rate (``gflops``) a throughput's FLOPs take."""
    if not gflops or not flops_per_token:
        return None
    return tokens_per_s * flops_per_token / (gflops * 1e9)


@dataclass(frozen=True)
class Ceiling:
    """A sweep's yardstick: the machine's matrix rate in the run's dtype, and the FLOPs a
    generated token of a point's trace costs."""

    work: TokenWork
    count_tokens: Callable[[str], int]  # a prompt's tokens, as the servers encode it
    dtype: str = "float32"

    @classmethod
    def of(
        cls, model: Path, adapter_dir: Path | None, adapters: Sequence[str], dtype: str
    ) -> Ceiling:
        from transformers import AutoTokenizer

        from lora_guard.engine.tokens import encode_text

        tokenizer = AutoTokenizer.from_pretrained(model)
        work = TokenWork.of(model, adapter_dir, adapters)
        return cls(work, lambda text: len(encode_text(tokenizer, text)), dtype)

    def machine_gflops(self) -> float:
        return machine_speed(dtype=self.dtype)

    def flops(self, trace: Sequence[TraceRequest]) -> float:
        return self.work.mean_flops(trace, [self.count_tokens(r.prompt) for r in trace])
