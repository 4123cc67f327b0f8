"""The oracle: each request's greedy tokens with no KV shared with any other request.

Computed in one batch with the prefix cache off and a slot for every adapter (the batch shares no
state, only arithmetic); a request whose scheme output differs is run again truly alone, and that
answer is the one compared.
"""

from __future__ import annotations

from dataclasses import dataclass

from lora_guard.bench.replay import EngineOptions
from lora_guard.engine import LLM, SamplingParams


@dataclass(frozen=True)
class OracleRequest:
    key: str
    prompt: str
    adapter_id: str | None
    max_new_tokens: int
    ignore_eos: bool = True  # False for a server's outputs, which end at EOS


def oracle_tokens(
    requests: list[OracleRequest], options: EngineOptions, solo: bool = False
) -> dict[str, list[int]]:
    """Greedy tokens per request key: in one batch, or (``solo``) one request at a time."""
    adapters = {r.adapter_id for r in requests if r.adapter_id is not None}
    llm = LLM(
        options.model,
        adapter_dir=options.adapter_dir,
        policies="lru",
        max_loras=max(1, len(adapters)),
        max_cpu_loras=max(1, len(adapters)),
        max_lora_rank=options.max_lora_rank,
        kv_cache_memory=options.kv_cache_memory,
        max_num_seqs=options.max_num_seqs,
        enable_prefix_caching=False,
        dtype=options.dtype,
        lora_dtype=options.lora_dtype,
        device=options.device,
    )
    # A request the engine cannot take (too long) failed in every scheme too: nothing to compare.
    limit = llm.engine.max_model_len
    requests = [r for r in requests if len(llm.engine.encode(r.prompt)) + r.max_new_tokens <= limit]
    params = [
        SamplingParams(max_new_tokens=r.max_new_tokens, ignore_eos=r.ignore_eos) for r in requests
    ]
    prompts = [r.prompt for r in requests]
    ids = [r.adapter_id for r in requests]
    if solo:
        outputs = [llm.generate(p, s, [a])[0] for p, s, a in zip(prompts, params, ids, strict=True)]
    else:
        outputs = llm.generate(prompts, params, ids)
    llm.engine.check_no_leaks()
    llm.engine.shutdown()
    for request, out in zip(requests, outputs, strict=True):
        if out.error is not None:
            raise RuntimeError(f"the oracle failed on {request.key}: {out.error}")
    return {r.key: list(out.token_ids) for r, out in zip(requests, outputs, strict=True)}
