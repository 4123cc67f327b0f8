"""``lora-guard bench --sweep 1,2,4,8,16,32``: how much each system serves, each behind its own
HTTP server, measured by the same client (:mod:`lora_guard.bench.load`).

For each system in ``--systems`` (lora-guard, peft, vllm, llama.cpp), one after another: start its
server, warm it (one short request per adapter), then a closed loop of N clients on the trace for
each N of the sweep. The saturated throughput is the best N's; the knee, the fewest clients that
reach 95% of it. Then, with every system's capacity known, each is started
again and the trace arrives open-loop at ``--matched-load`` of the smallest capacity: the latency
each gives at the same load, below every system's knee. Before each point the machine's own speed
is measured, the server's processes stopped meanwhile (:mod:`lora_guard.bench.machine_speed`, in
the run's dtype), and kept beside it: on a
shared machine it moves, and a ratio of two systems measured minutes apart moves with it. Each
point's throughput is also read as a share of that rate (:mod:`lora_guard.bench.ceiling`): its
generated tokens' FLOPs a second over the machine's matrix FLOPs a second.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, replace
from itertools import chain
from pathlib import Path
from typing import Any

import httpx

from lora_guard.bench import load
from lora_guard.bench.arguments import workload_spec
from lora_guard.bench.ceiling import Ceiling, machine_share
from lora_guard.bench.load import RequestRecord, busy_throughput, closed_loop, open_loop
from lora_guard.bench.machine_speed import machine_speed
from lora_guard.bench.peer_env import PeerError
from lora_guard.bench.replay import EngineOptions
from lora_guard.bench.servers import ServerLaunch, paused, serving, shared, tree_rss
from lora_guard.bench.sweep_report import (
    ms,
    sweep_table,
    sweep_targets,
    target_lines,
    write_sweep_plot,
)
from lora_guard.bench.systems import SYSTEMS, System, make_system
from lora_guard.bench.time_split import RequestLogReader, split_text, time_split
from lora_guard.bench.vllm_peer import vllm_mode
from lora_guard.clock import monotonic
from lora_guard.demo.scrape import metric_samples
from lora_guard.workload.stats import percentile
from lora_guard.workload.trace import TraceRequest, WorkloadSpec, fresh_trace, mean_rate

KNEE_SHARE = 0.95  # the knee: the fewest clients that reach this share of the best throughput
FLAT = 1.05  # a point within this factor of the one before: the throughput is flat
BEYOND = 2  # a system still rising at the last N is swept up to this times the last N


@dataclass(frozen=True)
class Point:
    """One closed loop (or, with ``clients`` 0, the open-loop run at matched load)."""

    clients: int
    requests: int
    completed: int
    short: int  # completed with fewer tokens than asked
    retries: int  # requests sent again after a stale kept-alive connection
    tokens_per_s: float  # while every client was busy (closed loop), else over the whole run
    requests_per_s: float
    busy_s: float
    ttft_p50_ms: float | None
    ttft_p95_ms: float | None
    e2e_p95_ms: float | None
    # The machine's own speed just before the point (lora_guard.bench.machine_speed), the server
    # paused
    machine_gflops: float | None = None
    # prompt tokens the server found in its prefix cache over all it was sent, where it says
    prefix_cache_hit_rate: float | None = None
    # FLOPs a generated token of the point's trace costs (lora_guard.bench.ceiling), and the
    # share of the machine's matrix rate the throughput's FLOPs take
    flops_per_token: float | None = None
    machine_share: float | None = None
    # where the requests' time went, where the server logs its side (lora_guard.bench.time_split)
    time_split: dict[str, float] | None = None


def measure(
    replies: list[RequestRecord],
    trace: list[TraceRequest],
    clients: int,
    machine_gflops: float | None = None,
) -> Point:
    asked = {r.id: r.max_new_tokens for r in trace}
    done = [r for r in replies if r.error is None and r.finish is not None]
    ttft = [(r.first_token - (r.sent or 0.0)) * 1000 for r in done if r.first_token is not None]
    e2e = [(r.finish - (r.sent or 0.0)) * 1000 for r in done if r.finish is not None]
    if clients:
        tokens_per_s, busy = busy_throughput(replies, clients)
    else:
        busy = max((r.finish or 0.0) for r in replies) if replies else 0.0
        tokens_per_s = sum(r.generated for r in done) / busy if busy else 0.0
    mean_tokens = sum(r.generated for r in done) / len(done) if done else 0.0
    return Point(
        clients=clients,
        requests=len(trace),
        completed=len(done),
        short=sum(1 for r in done if r.generated < asked[r.id]),
        retries=sum(r.retries for r in replies),
        tokens_per_s=tokens_per_s,
        requests_per_s=tokens_per_s / mean_tokens if mean_tokens else 0.0,
        busy_s=busy,
        ttft_p50_ms=percentile(ttft, 50),
        ttft_p95_ms=percentile(ttft, 95),
        e2e_p95_ms=percentile(e2e, 95),
        machine_gflops=machine_gflops,
    )


def knee(points: Sequence[Point]) -> Point:
    """The fewest clients that reach :data:`KNEE_SHARE` of the saturated throughput."""
    best = saturated(points).tokens_per_s
    return min((p for p in points if p.tokens_per_s >= KNEE_SHARE * best), key=lambda p: p.clients)


def saturated(points: Sequence[Point]) -> Point:
    return max(points, key=lambda p: p.tokens_per_s)


class SweepTraces:
    """Each point's requests, ``max(least, 3 x clients)`` of them (each client gets a few turns):
    the trace's next requests whose prompts differ from each other (:func:`fresh_trace`) and
    from every prompt an earlier point sent, so no point sends a prompt the server has served
    before."""

    def __init__(self, spec: WorkloadSpec, adapters: list[str], least: int) -> None:
        self.spec, self.adapters, self.least = spec, adapters, least
        self.sent: set[str] = set()

    def point(self, clients: int) -> list[TraceRequest]:
        size = max(self.least, 3 * clients)
        drawn = fresh_trace(self.spec, self.adapters, len(self.sent) + size)
        out = [r for r in drawn if r.prompt not in self.sent][:size]
        self.sent.update(r.prompt for r in out)
        return out


def next_clients(points: Sequence[Point], limit: int) -> int | None:
    """Clients for one more point while the throughput still rises (the last point more than
    :data:`FLAT` times the one before): twice the last, up to ``limit``; None when flat or
    falling, or at the limit."""
    if len(points) < 2 or points[-1].clients * 2 > limit:
        return None
    last, before = points[-1].tokens_per_s, points[-2].tokens_per_s
    return points[-1].clients * 2 if last > FLAT * before else None


def run_system(
    system: System,
    log_file: Path,
    runs: list[tuple[int, list[TraceRequest]]],
    progress: Callable[[str], None],
    more: Callable[[list[Point]], tuple[int, list[TraceRequest]] | None] | None = None,
    ceiling: Ceiling | None = None,
) -> tuple[list[Point], int]:
    """Start ``system``, then for each (clients, trace) of ``runs``: -1 warms it (one client,
    not measured), 0 sends the trace open-loop, N > 0 runs a closed loop of N clients; then the
    runs ``more`` asks for, given the points so far, until it gives None; stop it. Returns the
    points and the server's peak RSS (its processes summed). ``ceiling``: the machine's rate
    in the run's dtype and each point's FLOPs a token (else the rate in float32 alone)."""
    points: list[Point] = []
    peak = 0
    route = load.completions(system.body)
    times = None if system.request_log is None else RequestLogReader(system.request_log)
    with serving(system.launch, _port(system.launch), log_file) as (server, url):

        def extra() -> Iterator[tuple[int, list[TraceRequest]]]:
            while more is not None and (run := more(points)) is not None:
                yield run

        for clients, trace in chain(runs, extra()):
            if clients < 0:  # the warm-up
                failed = [r.error for r in closed_loop(url, trace, 1, route) if r.error]
                if failed:
                    raise PeerError(f"{system.name}: the warm-up failed: {failed[0]}")
                if times is not None:
                    times.skip()
                continue
            with paused(server):  # the machine's own rate, not what the server leaves of it
                speed = ceiling.machine_gflops() if ceiling is not None else machine_speed()
            cached_before = cache_counts(url, system.cache_counters)
            started = monotonic()
            if clients:
                replies = closed_loop(url, trace, clients, route)
            else:
                with load.client(url, len(trace)) as http:
                    replies, _ = open_loop(http, trace, route)
            point = measure(replies, trace, clients, speed)
            hit_rate = cache_hit_rate(cached_before, cache_counts(url, system.cache_counters))
            point = replace(point, prefix_cache_hit_rate=hit_rate)
            if times is not None:
                point = replace(point, time_split=time_split(replies, times.new_lines()))
            if ceiling is not None:
                flops = ceiling.flops(trace)
                share = machine_share(point.tokens_per_s, flops, speed)
                point = replace(point, flops_per_token=flops, machine_share=share)
            peak = max(peak, tree_rss(server.pid))
            points.append(point)
            failed = [r.error for r in replies if r.error is not None]
            what = f"N={clients}" if clients else "matched load"
            cache = "" if hit_rate is None else f", prefix cache hit {hit_rate:.2f}"
            if point.machine_share is not None:
                cache += f", {point.machine_share:.2f} of the machine"
            if point.time_split is not None:
                cache += f"; time {split_text(point.time_split)}"
            progress(
                f"{system.name} {what}: {point.tokens_per_s:.1f} tok/s, TTFT p50 "
                f"{ms(point.ttft_p50_ms)} p95 {ms(point.ttft_p95_ms)}, "
                f"{point.completed}/{point.requests} done{cache} "
                f"({monotonic() - started:.0f} s; machine {speed:.0f} GFLOP/s)"
            )
            if failed:
                raise PeerError(f"{system.name}: {len(failed)} requests failed, e.g. {failed[0]}")
    return points, peak


def cache_counts(url: str, names: tuple[str, str] | None) -> tuple[float, float] | None:
    """The two counters ``names`` on the server's /metrics (each summed over its labels); None
    when the server has no such counters or does not answer."""
    if names is None:
        return None
    try:
        samples = metric_samples(url)
    except httpx.HTTPError:
        return None
    if any(name not in samples for name in names):
        return None
    hits, total = (sum(value for _, value in samples[name]) for name in names)
    return hits, total


def cache_hit_rate(
    before: tuple[float, float] | None, after: tuple[float, float] | None
) -> float | None:
    """Prompt tokens found in the prefix cache over all prompt tokens, between two readings."""
    if before is None or after is None or after[1] <= before[1]:
        return None
    return (after[0] - before[0]) / (after[1] - before[1])


def _port(launch: ServerLaunch) -> int:
    return int(launch.command[launch.command.index("--port") + 1])


def run(args: argparse.Namespace, argv: Sequence[str]) -> int:

    started = monotonic()

    def progress(what: str) -> None:
        print(f"[{monotonic() - started:6.1f} s] {what}", file=sys.stderr, flush=True)

    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown or not systems:
        print(
            f"error: unknown system {unknown[0] if unknown else ''!r}; choose from "
            f"{', '.join(SYSTEMS)}",
            file=sys.stderr,
        )
        return 2
    sweep = sorted(set(args.sweep))
    from lora_guard.demo.model import prepare_demo

    demo = prepare_demo(log=progress)
    model = args.model or demo.model_dir
    adapter_dir = args.adapter_dir or demo.adapter_dir
    spec = replace(workload_spec(args), seed=(args.seeds or [0])[0])
    from lora_guard.bench.replay import adapter_ids

    adapters = adapter_ids(adapter_dir)[: args.adapters]
    # Base-model traffic alone is each system's no-LoRA control: started without adapters (vLLM
    # without --enable-lora, llama.cpp without --lora, PEFT on the bare model).
    served = [] if spec.base_share >= 1 else adapters
    options = EngineOptions(
        model=str(model),
        adapter_dir=str(adapter_dir),
        max_loras=args.max_loras,
        max_lora_rank=args.max_lora_rank,
        kv_cache_memory=args.kv_cache_memory,
        dtype=args.dtype,
        max_num_seqs=max(64, BEYOND * max(sweep)),
    )
    ceiling = Ceiling.of(Path(model), Path(adapter_dir), adapters, args.dtype)
    warm = [TraceRequest(f"warm-{a}", 0.0, "t0", a, "Warm-up.", 2) for a in [None, *served]]
    report: dict[str, Any] = {
        "command": "lora-guard " + " ".join(argv),
        "regime": _regime(args),
        "workload": asdict(spec),
        "systems": {},
    }
    logs: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="lora-guard-sweep-") as scratch:
        # lora-guard's server logs each request's times; the JSON keeps each point's split
        options = replace(options, request_log=str(Path(scratch) / "lora-guard-requests.jsonl"))
        try:
            made = {
                name: make_system(name, options, served, args.peer_port + i, progress)
                for i, name in enumerate(systems)
            }
            for name, system in made.items():
                traces = SweepTraces(spec, adapters, args.requests)
                report["systems"][name] = _sweep_one(
                    name, system, traces, sweep, warm, Path(scratch), progress, ceiling, logs
                )
            matched = _matched_trace(report, spec, adapters, args)
            for name, system in made.items():
                rate = report["matched"]["requests_per_s"]
                progress(f"{name}: the trace at {rate:.2f} requests/s (matched load)")
                log = Path(scratch) / f"{name}-matched.log"
                points, _ = run_system(
                    system, log, [(-1, warm), (0, matched)], progress, ceiling=ceiling
                )
                logs[f"{name}-matched"] = shared(log.read_text(errors="replace"))
                report["systems"][name]["matched"] = asdict(points[0])
                if system.request_log is not None and system.request_log.exists():
                    logs[f"{name}-requests"] = system.request_log.read_text()
        except (PeerError, OSError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    report["targets"] = sweep_targets(report["systems"])
    report["duration_s"] = monotonic() - started
    _write(args, report, logs)
    return 0


def _sweep_one(
    name: str,
    system: System,
    traces: SweepTraces,
    sweep: list[int],
    warm: list[TraceRequest],
    scratch: Path,
    progress: Callable[[str], None],
    ceiling: Ceiling,
    logs: dict[str, str],
) -> dict[str, Any]:
    """``system`` through the sweep's client counts, then on until its throughput is flat or
    falling (``next_clients``): its report entry; its log goes into ``logs``."""
    progress(f"{name}: sweeping N = {', '.join(map(str, sweep))}")
    runs = [(-1, warm)] + [(n, traces.point(n)) for n in sweep]

    def more(points: list[Point]) -> tuple[int, list[TraceRequest]] | None:
        n = next_clients(points, BEYOND * max(sweep))
        return None if n is None else (n, traces.point(n))

    log = scratch / f"{name}.log"
    points, peak = run_system(system, log, runs, progress, more, ceiling)
    logs[f"{name}-sweep"] = shared(log.read_text(errors="replace"))
    return {
        "launch": system.launch.as_json(),
        **({"mode": vllm_mode(logs[f"{name}-sweep"])} if "vllm" in name else {}),
        "points": [asdict(p) for p in points],
        "saturated": asdict(saturated(points)),
        "knee_clients": knee(points).clients,
        "peak_rss": peak,
    }


def _matched_trace(
    report: dict[str, Any], spec: WorkloadSpec, adapters: list[str], args: argparse.Namespace
) -> list[TraceRequest]:
    """A trace new to every system at ``--matched-load`` of the smallest saturated rate of the
    sweep; what it is goes into ``report["matched"]``."""
    capacity = min(s["saturated"]["requests_per_s"] for s in report["systems"].values())
    rate = args.matched_load * capacity
    matched = fresh_trace(
        replace(spec, rate=rate / (mean_rate(spec) / spec.rate)), adapters, args.requests
    )
    report["matched"] = {
        "load": args.matched_load,
        "of_requests_per_s": capacity,
        "requests_per_s": rate,
        "requests": len(matched),
    }
    return matched


def _write(args: argparse.Namespace, report: dict[str, Any], logs: dict[str, str]) -> None:
    """The table and the targets; the JSON with each run's server log beside it; the plots."""
    print(sweep_table(report["systems"]))
    print("\n" + "\n".join(target_lines(report["targets"])))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        for name, text in logs.items():
            args.json.with_name(f"{args.json.stem}.{name}.log").write_text(text)
    if args.plots:
        for path in write_sweep_plot(report["systems"], args.plots):
            print(f"wrote {path}", file=sys.stderr)


def _regime(args: argparse.Namespace) -> str:
    seats = args.max_loras or args.adapters
    if args.base_share >= 1:
        return "base model only, no adapters served"
    if seats >= args.adapters:
        return f"everything fits: {args.adapters} adapters, {seats} seats"
    return f"adapters under pressure: {args.adapters} adapters on {seats} seats"
