"""``lora-guard bench --sweep 1,2,4,8,16,32``: how much each system serves, each behind its own
HTTP server, measured by the same client (:mod:`lora_guard.bench.load`).

For each system in ``--systems`` (lora-guard, peft, vllm, llama.cpp), one after another: start its
server, warm it (one short request per adapter), then a closed loop of N clients on the trace for
each N of the sweep. The saturated throughput is the best N's; the knee, the fewest clients that
reach 95% of it. Then, with every system's capacity known, each is started
again and the trace arrives open-loop at ``--matched-load`` of the smallest capacity: the latency
each gives at the same load, below every system's knee. Before each point the machine's own speed
is measured (:mod:`lora_guard.bench.machine_speed`, in the run's dtype) and kept beside it: on a
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

from lora_guard.bench.arguments import workload_spec
from lora_guard.bench.ceiling import Ceiling, machine_share
from lora_guard.bench.load import Reply, busy_throughput, closed_loop, open_loop
from lora_guard.bench.machine_speed import machine_speed
from lora_guard.bench.peer_env import PeerError
from lora_guard.bench.replay import EngineOptions
from lora_guard.bench.servers import (
    ServerLaunch,
    shared,
    start_server,
    stop_server,
    tree_rss,
    wait_ready,
)
from lora_guard.bench.systems import SYSTEMS, System, make_system
from lora_guard.bench.vllm_peer import vllm_mode
from lora_guard.clock import monotonic
from lora_guard.demo.testing import metric_samples
from lora_guard.workload.stats import percentile
from lora_guard.workload.trace import TraceRequest, WorkloadSpec, fresh_trace, mean_rate

KNEE_SHARE = 0.95  # the knee: the fewest clients that reach this share of the best throughput
MACHINE_SHARE_TARGET = 0.5  # lora-guard's saturated FLOPs a second, at least this of the machine's
LATENCY_TARGET = 0.5  # lora-guard's TTFT p95 at matched load, at most this share of each peer's
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
    # The machine's own speed just before the point (lora_guard.bench.machine_speed), server idle
    machine_gflops: float | None = None
    # prompt tokens the server found in its prefix cache over all it was sent, where it says
    prefix_cache_hit_rate: float | None = None
    # FLOPs a generated token of the point's trace costs (lora_guard.bench.ceiling), and the
    # share of the machine's matrix rate the throughput's FLOPs take
    flops_per_token: float | None = None
    machine_share: float | None = None


def measure(
    replies: list[Reply],
    trace: list[TraceRequest],
    clients: int,
    machine_gflops: float | None = None,
) -> Point:
    asked = {r.id: r.max_new_tokens for r in trace}
    done = [r for r in replies if r.error is None and r.finish is not None]
    ttft = [(r.first_token - r.sent) * 1000 for r in done if r.first_token is not None]
    e2e = [(r.finish - r.sent) * 1000 for r in done if r.finish is not None]
    if clients:
        tokens_per_s, busy = busy_throughput(replies, clients)
    else:
        busy = max((r.finish or 0.0) for r in replies) if replies else 0.0
        tokens_per_s = sum(r.tokens for r in done) / busy if busy else 0.0
    mean_tokens = sum(r.tokens for r in done) / len(done) if done else 0.0
    return Point(
        clients=clients,
        requests=len(trace),
        completed=len(done),
        short=sum(1 for r in done if r.tokens < asked[r.id]),
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
    server = start_server(system.launch, log_file)
    points: list[Point] = []
    peak = 0
    try:
        url = f"http://127.0.0.1:{_port(system.launch)}"
        wait_ready(server, url, log_file)

        def extra() -> Iterator[tuple[int, list[TraceRequest]]]:
            while more is not None and (run := more(points)) is not None:
                yield run

        for clients, trace in chain(runs, extra()):
            if clients < 0:  # the warm-up
                failed = [r.error for r in closed_loop(url, trace, 1, system.body) if r.error]
                if failed:
                    raise PeerError(f"{system.name}: the warm-up failed: {failed[0]}")
                continue
            speed = ceiling.machine_gflops() if ceiling is not None else machine_speed()
            cached_before = cache_counts(url, system.cache_counters)
            started = monotonic()
            if clients:
                replies = closed_loop(url, trace, clients, system.body)
            else:
                replies = open_loop(url, trace, system.body)
            point = measure(replies, trace, clients, speed)
            hit_rate = cache_hit_rate(cached_before, cache_counts(url, system.cache_counters))
            point = replace(point, prefix_cache_hit_rate=hit_rate)
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
            progress(
                f"{system.name} {what}: {point.tokens_per_s:.1f} tok/s, TTFT p50 "
                f"{_ms(point.ttft_p50_ms)} p95 {_ms(point.ttft_p95_ms)}, "
                f"{point.completed}/{point.requests} done{cache} "
                f"({monotonic() - started:.0f} s; machine {speed:.0f} GFLOP/s)"
            )
            if failed:
                raise PeerError(f"{system.name}: {len(failed)} requests failed, e.g. {failed[0]}")
    finally:
        stop_server(server)
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


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f} ms"


def _share(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _gflops(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


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
    warm = [TraceRequest(f"warm-{a}", 0.0, "t0", a, "Warm-up.", 2) for a in [None, *adapters]]
    report: dict[str, Any] = {
        "command": "lora-guard " + " ".join(argv),
        "regime": _regime(args),
        "workload": asdict(spec),
        "systems": {},
    }
    logs: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="lora-guard-sweep-") as scratch:
        try:
            made = {
                name: make_system(name, options, adapters, args.peer_port + i, progress)
                for i, name in enumerate(systems)
            }
            for name, system in made.items():
                progress(f"{name}: sweeping N = {', '.join(map(str, sweep))}")
                traces = SweepTraces(spec, adapters, args.requests)
                runs = [(-1, warm)] + [(n, traces.point(n)) for n in sweep]

                def more(
                    points: list[Point], traces: SweepTraces = traces
                ) -> tuple[int, list[TraceRequest]] | None:
                    n = next_clients(points, BEYOND * max(sweep))
                    return None if n is None else (n, traces.point(n))

                log = Path(scratch) / f"{name}.log"
                points, peak = run_system(system, log, runs, progress, more, ceiling)
                logs[f"{name}-sweep"] = shared(log.read_text(errors="replace"))
                report["systems"][name] = {
                    "launch": system.launch.as_json(),
                    **({"mode": vllm_mode(logs[f"{name}-sweep"])} if "vllm" in name else {}),
                    "points": [asdict(p) for p in points],
                    "saturated": asdict(saturated(points)),
                    "knee_clients": knee(points).clients,
                    "peak_rss": peak,
                }
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
            for name, system in made.items():
                progress(f"{name}: the trace at {rate:.2f} requests/s (matched load)")
                log = Path(scratch) / f"{name}-matched.log"
                points, _ = run_system(
                    system, log, [(-1, warm), (0, matched)], progress, ceiling=ceiling
                )
                logs[f"{name}-matched"] = shared(log.read_text(errors="replace"))
                report["systems"][name]["matched"] = asdict(points[0])
        except (PeerError, OSError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    report["targets"] = sweep_targets(report["systems"])
    report["duration_s"] = monotonic() - started
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
    return 0


def _regime(args: argparse.Namespace) -> str:
    seats = args.max_loras or args.adapters
    if args.base_share >= 1:
        return "base model only"
    if seats >= args.adapters:
        return f"everything fits: {args.adapters} adapters, {seats} seats"
    return f"adapters under pressure: {args.adapters} adapters on {seats} seats"


def sweep_targets(systems: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """lora-guard's saturated throughput against the machine's matrix rate, and its saturated
    and one-client throughput and matched-load TTFT p95 against each peer's, by each peer's
    goals (``systems.SYSTEMS``)."""
    ours = systems.get("lora-guard")
    if ours is None:
        return []
    found = []
    share = ours["saturated"].get("machine_share")
    if share is not None:
        found.append(
            {
                "what": "saturated tok/s x FLOPs a token over the machine's matrix rate",
                "goal": f">= {MACHINE_SHARE_TARGET:g}",
                "value": share,
                "met": share >= MACHINE_SHARE_TARGET,
            }
        )
    for peer, entry in SYSTEMS.items():
        goal = entry.throughput_goal
        if goal is None or peer not in systems:
            continue
        theirs = systems[peer]
        ratio = _ratio(ours["saturated"]["tokens_per_s"], theirs["saturated"]["tokens_per_s"])
        found.append(
            {
                "what": f"saturated tok/s vs {peer}",
                "goal": f">= {goal:g}x",
                "value": ratio,
                "met": ratio is not None and ratio >= goal,
            }
        )
        one = entry.one_client_goal
        ratio = _ratio(_one_client(ours), _one_client(theirs))
        if one is not None and ratio is not None:
            found.append(
                {
                    "what": f"tok/s at one client vs {peer}",
                    "goal": f">= {one:g}x",
                    "value": ratio,
                    "met": ratio >= one,
                }
            )
        if "matched" in ours and "matched" in theirs:
            ratio = _ratio(ours["matched"]["ttft_p95_ms"], theirs["matched"]["ttft_p95_ms"])
            found.append(
                {
                    "what": f"TTFT p95 at matched load vs {peer}",
                    "goal": f"<= {LATENCY_TARGET:g}x",
                    "value": ratio,
                    "met": ratio is not None and ratio <= LATENCY_TARGET,
                }
            )
    return found


def _one_client(found: dict[str, Any]) -> float | None:
    return next((p["tokens_per_s"] for p in found.get("points", ()) if p["clients"] == 1), None)


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def target_lines(targets: list[dict[str, Any]]) -> list[str]:
    lines = []
    for t in targets:
        unit = "x" if t["goal"].endswith("x") else ""  # a ratio; a share has none
        value = "-" if t["value"] is None else f"{t['value']:.3g}{unit}"
        lines.append(
            f"{t['what']}: {value} (target {t['goal']}): {'met' if t['met'] else 'missed'}"
        )
    return lines


def sweep_table(systems: dict[str, dict[str, Any]]) -> str:
    rows = [
        "| system | clients | tok/s | TTFT p50 | TTFT p95 | e2e p95 | done | prefix cache hit "
        "| machine GFLOP/s | of the machine |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, found in systems.items():
        best = found["saturated"]["clients"]
        for p in [*found["points"], *([found["matched"]] if "matched" in found else [])]:
            clients = str(p["clients"]) if p["clients"] else "matched load"
            mark = " (saturated)" if p["clients"] == best else ""
            rows.append(
                f"| {name} | {clients}{mark} | {p['tokens_per_s']:.1f} | "
                f"{_ms(p['ttft_p50_ms'])} | {_ms(p['ttft_p95_ms'])} | "
                f"{_ms(p['e2e_p95_ms'])} | {p['completed']}/{p['requests']} | "
                f"{_share(p.get('prefix_cache_hit_rate'))} | {_gflops(p.get('machine_gflops'))} | "
                f"{_share(p.get('machine_share'))} |"
            )
    return "\n".join(rows)


def write_sweep_plot(systems: dict[str, dict[str, Any]], folder: Path) -> list[Path]:
    """capacity.png: tok/s and TTFT p95 against the clients in the loop, a line per system."""
    from lora_guard.bench.plots import colour, pyplot, save

    plt = pyplot()
    folder.mkdir(parents=True, exist_ok=True)
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, found in systems.items():
        clients = [p["clients"] for p in found["points"]]
        left.plot(
            clients,
            [p["tokens_per_s"] for p in found["points"]],
            marker="o",
            label=name,
            color=colour(name),
        )
        right.plot(
            clients,
            [p["ttft_p95_ms"] for p in found["points"]],
            marker="o",
            label=name,
            color=colour(name),
        )
    left.set_ylabel("generated tokens/s (all clients busy)")
    right.set_ylabel("TTFT p95 (ms)")
    right.set_yscale("log")
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("clients in the closed loop")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    return [save(fig, folder / "capacity.png")]
