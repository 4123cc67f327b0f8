"""The oracle: each request's greedy tokens with no KV shared with any other request.

Computed in one batch with the prefix cache off and a slot for every adapter (the batch shares no
state, only arithmetic); a request whose scheme output differs is run again truly alone, and that
answer is the one compared.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from lora_guard.bench.isolate import call_in_process
from lora_guard.bench.replay import EngineOptions, SchemeRun
from lora_guard.engine import SamplingParams
from lora_guard.workload.trace import TraceRequest


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
    llm = options.llm(
        policies="lru",
        max_loras=max(1, len(adapters)),
        max_cpu_loras=max(1, len(adapters)),
        enable_prefix_caching=False,
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


def oracle_mismatches(
    turns: list[dict[str, SchemeRun]],
    trace: list[TraceRequest],
    options: EngineOptions,
    static_id: str,
    isolated: bool,
) -> list[dict[str, int]]:
    """Per turn and scheme, the requests whose tokens differ from the same request run alone
    (one oracle for every turn of the trace)."""
    requests: dict[str, OracleRequest] = {}
    for name in {name for runs in turns for name in runs}:
        served = static_id if name == "static" else None
        for request in trace:
            adapter = served or request.adapter_id
            key = f"{request.id}@{adapter}"
            requests[key] = OracleRequest(key, request.prompt, adapter, request.max_new_tokens)
    oracle = call_in_process(isolated, oracle_tokens, list(requests.values()), options)

    def differing() -> list[dict[str, list[str]]]:
        return [
            {name: _differing(run, oracle, static_id) for name, run in runs.items()}
            for runs in turns
        ]

    found = differing()
    doubtful = sorted({key for by_scheme in found for keys in by_scheme.values() for key in keys})
    if doubtful:
        print(f"running {len(doubtful)} requests alone to confirm ...", file=sys.stderr)
        alone = call_in_process(
            isolated, oracle_tokens, [requests[k] for k in doubtful], options, True
        )
        oracle.update(alone)
        found = differing()
    return [{name: len(keys) for name, keys in by_scheme.items()} for by_scheme in found]


def _differing(run: SchemeRun, oracle: dict[str, list[int]], static_id: str) -> list[str]:
    differing = []
    for record in run.records:
        if record.error is not None:
            continue
        adapter = static_id if run.scheme == "static" else record.adapter_id
        key = f"{record.id}@{adapter}"
        if key in oracle and record.tokens != oracle[key]:
            differing.append(key)
    return differing


def target_mismatches(run: SchemeRun, trace: list[TraceRequest], options: EngineOptions) -> int:
    """Requests of a run against a server whose tokens differ from the same request run alone
    here, on the checkpoint ``options`` names (the server's own stop rules kept)."""
    wanted = [
        OracleRequest(r.id, r.prompt, r.adapter_id, r.max_new_tokens, ignore_eos=False)
        for r in trace
    ]
    oracle = call_in_process(True, oracle_tokens, wanted, options)
    return sum(
        1 for r in run.records if r.id in oracle and r.error is None and r.tokens != oracle[r.id]
    )
