"""``python -m lora_guard.bench.virtual_time``: the bench's workload through the real engine and
its policies, on a clock that each step's modelled cost moves.

A wall-clock replay on a shared machine measures the machine as much as the policies. Here the real
engine (scheduler, residency, cache pool, policies, a tiny model's forward) runs every step as fast
as it can, and the engine's clock (``time.monotonic``, which every policy and the residency quantum
read) advances by what that step would cost on the demo model: the simulator's calibrated costs
(``simulate_costs.Costs``: a fixed part, a part per sequence, per MiB of adapter weights the batch
reads and per prompt token, plus each adapter written into the pool). A read from disk lands at the
next step. Arrivals are replayed on that clock, at ``--load`` of the capacity measured the same way
(the bench's capacity run, on the base model). The same command gives the same figures on any
machine, busy or not; what it cannot show is a real cost the model leaves out.

    python -m lora_guard.bench.virtual_time --max-loras 8 --schemes base,lru,lora-guard
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from lora_guard.bench.capacity import CAPACITY_BATCH, Capacity, arrival_rate, capacity_prompts
from lora_guard.bench.replay import RequestRecord
from lora_guard.bench.report import decode_tokens_per_s, request_tokens_per_s
from lora_guard.bench.stats import percentile
from lora_guard.bench.workload import SCENARIOS, TraceRequest, WorkloadSpec, make_trace
from lora_guard.simulate_costs import Costs, read_costs

SCHEMES = {"base": "lru", "lru": "lru", "lora-guard": None}  # scheme -> policies (None: defaults)
IDLE_S = 100.0  # virtual seconds between the warm-up and the replay: the warm-up's heat is gone


class VirtualClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@contextmanager
def virtual_clock() -> Iterator[VirtualClock]:
    """``time.monotonic`` answers the clock's time until the block ends."""
    clock, real = VirtualClock(), time.monotonic
    time.monotonic = clock
    try:
        yield clock
    finally:
        time.monotonic = real


@dataclass(frozen=True)
class Result:
    scheme: str
    records: list[RequestRecord]
    loads: int

    def figures(self) -> dict[str, Any]:
        done = [r for r in self.records if r.error is None and r.first_token is not None]
        ttft = [(r.first_token - r.arrival) * 1000 for r in done if r.first_token is not None]
        speeds = [s for r in done if (s := request_tokens_per_s(r)) is not None]
        decode = [s for r in done if (s := decode_tokens_per_s(r)) is not None]
        return {"scheme": self.scheme, "completed": f"{len(done)}/{len(self.records)}",
                "ttft_p50_ms": percentile(ttft, 50), "ttft_p95_ms": percentile(ttft, 95),
                "tail_tokens_per_s": percentile(speeds, 5),
                "decode_tail_tokens_per_s": percentile(decode, 5), "loads": self.loads}  # fmt: skip


class Replay:
    """One engine driven step by step on the virtual clock."""

    def __init__(self, llm: Any, clock: VirtualClock, costs: Costs) -> None:
        self.llm, self.engine, self.clock, self.costs = llm, llm.engine, clock, costs

    def step(self) -> list[Any]:
        """One engine step; the clock moves by its cost (a read from disk lands by the next)."""
        stats, loads = self.engine.stats, self.engine.adapters.stats.loads
        steps = stats.steps
        outputs = self.engine.step()
        written = self.engine.adapters.stats.loads - loads
        cost_ms = 1.0  # a step that computed nothing
        if stats.steps > steps:
            ran = stats.recent_steps[-1]
            cost_ms = self.costs.step(ran.seqs, ran.adapters, ran.prefill_tokens)
        self.clock.now += (cost_ms + written * self.costs.write()) / 1000
        while not all(f.done() for f in self.engine.adapters.loader.pending.values()):
            time.sleep(0.0005)
        return list(outputs)

    def run(self, trace: Sequence[TraceRequest], adapters: bool) -> list[RequestRecord]:
        from lora_guard.engine import SamplingParams

        start = self.clock.now
        pending = sorted(trace, key=lambda r: r.time)
        records: dict[str, RequestRecord] = {}
        i = 0
        while i < len(pending) or self.engine.has_unfinished_requests():
            idle = not self.engine.has_unfinished_requests()
            if idle and self.clock.now - start < pending[i].time:
                self.clock.now = start + pending[i].time  # nothing to do until the next arrival
            while i < len(pending) and pending[i].time <= self.clock.now - start:
                r = pending[i]
                i += 1
                params = SamplingParams(max_new_tokens=r.max_new_tokens, ignore_eos=True)
                adapter = r.adapter_id if adapters else None
                self.engine.add_request(r.id, self.llm.tokenizer.encode(r.prompt), params,
                                        adapter, r.tenant)  # fmt: skip
                records[r.id] = RequestRecord(r.id, adapter, r.time)
            for out in self.step():
                record, now = records[out.request_id], self.clock.now - start
                if out.token_ids and record.first_token is None:
                    record.first_token = now
                if out.finished:
                    record.finish, record.tokens, record.error = now, list(out.token_ids), out.error
        return list(records.values())


def warm_up(replay: Replay, adapter_ids: Sequence[str]) -> None:
    """Every adapter read into host memory once, as the bench's warm-up does."""
    from lora_guard.engine import SamplingParams

    params = SamplingParams(max_new_tokens=1, ignore_eos=True)
    for i, adapter in enumerate(adapter_ids):
        replay.engine.add_request(f"warm-{i}", [5, 6, 7], params, adapter)
    while replay.engine.has_unfinished_requests():
        replay.step()
    replay.clock.now += IDLE_S


def capacity(
    llm: Any, clock: VirtualClock, costs: Costs, spec: WorkloadSpec, ids: list[str]
) -> Capacity:
    """The bench's capacity run (``CAPACITY_BATCH`` requests at once, base model), virtually."""
    trace = [TraceRequest(f"cap-{i}", 0.0, "t0", None, prompt, n)
             for i, (prompt, n) in enumerate(capacity_prompts(spec, ids))]  # fmt: skip
    replay = Replay(llm, clock, costs)
    started = clock.now
    records = replay.run(trace, adapters=False)
    elapsed = clock.now - started
    tokens = sum(len(r.tokens) for r in records)
    return Capacity(len(records) / elapsed, tokens / elapsed, CAPACITY_BATCH, tokens / len(records))


def study(
    spec: WorkloadSpec, schemes: Sequence[str], max_loras: int, costs: Costs, load: float,
    make_llm: Callable[..., Any], adapter_ids: list[str],
) -> tuple[float, list[Result]]:  # fmt: skip
    """The rate the load sets, and each scheme's result on the same trace."""
    with virtual_clock() as clock:
        base = make_llm(policies="lru")
        cap = capacity(base, clock, costs, spec, adapter_ids)
        base.engine.shutdown()
    rate = arrival_rate(spec, load, cap)
    trace = make_trace(replace(spec, rate=rate), adapter_ids)
    results = []
    for scheme in schemes:
        with virtual_clock() as clock:
            llm = make_llm(policies=SCHEMES[scheme], max_loras=max_loras)
            replay = Replay(llm, clock, costs)
            warm_up(replay, adapter_ids)
            loads = llm.engine.adapters.stats.loads
            records = replay.run(trace, adapters=scheme != "base")
            llm.engine.check_no_leaks()
            results.append(Result(scheme, records, llm.engine.adapters.stats.loads - loads))
            llm.engine.shutdown()
    return rate, results


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m lora_guard.bench.virtual_time",
        description="The bench workload through the real engine and policies on a virtual clock.",
    )
    parser.add_argument("--schemes", default="base,lru,lora-guard",
                        help=f"comma-separated, of {', '.join(SCHEMES)}")  # fmt: skip
    parser.add_argument("--max-loras", type=int, default=0, help="adapter seats (0: no cap)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--adapters", type=int, default=24)
    parser.add_argument("--load", type=float, default=0.7, help="share of the capacity")
    parser.add_argument("--scenario", choices=SCENARIOS, default="zipf")
    parser.add_argument("--output-mean", type=float, default=64.0)
    parser.add_argument("--costs", type=Path, help="costs JSON (simulate --calibrate)")
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args(argv)
    schemes = [s for s in args.schemes.split(",") if s]
    unknown = [s for s in schemes if s not in SCHEMES]
    if unknown:
        parser.error(f"unknown scheme {unknown[0]!r}; choose from {', '.join(SCHEMES)}")
    from lora_guard.adapter_maker import make_adapters
    from lora_guard.engine import LLM
    from lora_guard.testing import make_tiny_llama

    costs = read_costs(args.costs) if args.costs else Costs()
    spec = WorkloadSpec(requests=args.requests, adapters=args.adapters, seed=args.seed,
                        scenario=args.scenario, output_mean=args.output_mean)  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_llama(Path(tmp) / "model", max_position_embeddings=4096)
        folders = make_adapters(model, Path(tmp) / "adapters", n=spec.adapters, ranks=(4, 8, 16),
                                prefix="demo", all_projections=True)  # fmt: skip
        ids = sorted(f.name for f in folders)

        def make_llm(**kw: Any) -> Any:
            return LLM(model, adapter_dir=Path(tmp) / "adapters", max_cpu_loras=len(ids),
                       cache_memory="64MiB", **kw)  # fmt: skip

        rate, results = study(spec, schemes, args.max_loras, costs, args.load, make_llm, ids)
    rows = [r.figures() for r in results]
    print(f"virtual time: {len(schemes)} schemes, seed {args.seed}, {args.requests} requests, "
          f"load {args.load} (rate {rate:.3f}/s outside bursts), max_loras {args.max_loras}; "
          f"costs: {costs.source}")  # fmt: skip
    keys = list(rows[0]) if rows else []
    print("| " + " | ".join(keys) + " |")
    print("|" + "---|" * len(keys))
    for row in rows:
        print("| " + " | ".join(_cell(row[k]) for k in keys) + " |")
    if args.json:
        args.json.write_text(json.dumps({"rate": rate, "rows": rows}, indent=2))
    return 0


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value)


if __name__ == "__main__":
    raise SystemExit(main())
