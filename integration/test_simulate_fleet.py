"""The calibrated simulator against a real 2-replica Ray Serve fleet on one seeded trace.

The fleet is ``lora-guard serve-ray``'s: two engine replicas of the tiny model (3 adapter seats,
policy ``lru``, one torch thread each) behind the adapter-affinity router, reached over real
HTTP through Ray Serve's proxy and the ingress. Four clients replay the trace in a closed loop:
each sends the trace's next request on ``/generate`` once its last one is answered. A closed
loop because the simulator replays it exactly (``simulate(clients=4)``: the same requests in the
same order, each sent when a client is free) and because it keeps both replicas busy without
letting queues grow, so that the latency is the engine's steps and loads rather than how long a
queue got on a shared CPU. ``/generate`` (one response, not a token stream) so that the fleet's
own work per token is not in the way of the engine's steps.

Measured on the fleet: adapter loads (the replicas' own count, ``routing_stats()["loads"]``) and
the latency p95 of the requests as the clients see it (from sending a request to having its
whole answer). Simulated: the same trace (its prompts' lengths in the model's tokens, each
request's output length as the fleet answered it) on 2 replicas of 3 seats behind the
``lora-guard`` router, set as the fleet is (its spread queue, queue cap, stats period and Ray
Serve's controller ticks), with the engine's costs calibrated in this process on an engine with
the replicas' settings, just before and just after the trace, averaged. The fleet's time outside
the engine (HTTP, the proxy, the ingress, Ray's handle) is measured too: one-token requests on
the base model, one at a time through the idle fleet, less the engine's one step for each.

Loads and latency p95 must agree within 15%. A real-time replay on a shared CPU can be slowed by
another process at any moment, so the test makes up to 3 runs, each on a fresh fleet with its own
calibrations, and passes when one agrees (as ``tests/test_simulate.py`` does); a systematic model
error fails all three. ``pytest -s integration/test_simulate_fleet.py`` prints the figures.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, fields
from pathlib import Path

import httpx
import pytest
import torch

from lora_guard.adapter_maker import make_adapters
from lora_guard.bench.stats import percentile
from lora_guard.bench.workload import TraceRequest, WorkloadSpec, make_trace
from lora_guard.config import load_settings
from lora_guard.engine import LLM
from lora_guard.simulate import SimRequest, SimResult, simulate
from lora_guard.simulate_costs import Costs, calibrate
from lora_guard.testing import free_port

ray = pytest.importorskip("ray", reason="needs lora-guard[ray]")
serve = pytest.importorskip("ray.serve")

from ray.serve._private.constants import CONTROL_LOOP_INTERVAL_S  # noqa: E402

from lora_guard import serve_ray  # noqa: E402
from lora_guard.serve_ray.app import fleet_stats  # noqa: E402

REPLICAS, SEATS, CLIENTS = 2, 3, 4
STATS_PERIOD_S = 0.5
SPEC = WorkloadSpec(
    adapters=12, tenants=2, requests=160, zipf=1.0, seed=5, system_prompt_words=12,
    user_words_mean=6, output_mean=48, output_min=8, output_max=128,
)  # fmt: skip
PROBES = 20  # one-token requests that measure the fleet's time outside the engine
TOLERANCE = 0.15
ATTEMPTS = 3  # a real-time replay on a shared CPU: another process may slow one run down


@dataclass
class Answer:
    status: int = 0
    generated: int = 0  # tokens
    seconds: float = 0.0
    error: str | None = None


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory, tiny: tuple[Path, Path]) -> tuple[Path, Path]:
    model, _ = tiny
    adapters = tmp_path_factory.mktemp("simulated-fleet-adapters")
    make_adapters(model, adapters, n=SPEC.adapters, ranks=(4, 8), strength=0.5, prefix="s")
    return model, adapters


@pytest.fixture(scope="module")
def port() -> Iterator[int]:
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield free_port()
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture
def one_thread() -> Iterator[None]:
    """One torch thread in this process, as each replica has."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def replica_argv(files: tuple[Path, Path], port: int) -> list[str]:
    """The replicas' ``lora-guard serve`` settings: the policy the simulator models (``lru``),
    and no prefix cache (it does not model one)."""
    model, adapters = files
    return ["--model", str(model), "--adapter-dir", str(adapters), "--host", "127.0.0.1",
            "--port", str(port), "--kv-cache-memory", "16MiB", "--block-size", "4",
            "--max-loras", str(SEATS), "--policies", "lru", "--no-prefix-caching"]  # fmt: skip


def replica_llm(argv: list[str]) -> LLM:
    """An engine in this process with the replicas' settings."""
    settings = load_settings(argv)
    return LLM(**settings.engine_kwargs(), policies=list(settings.policies),
               settings=settings.plugin_settings())  # fmt: skip


def calibrated(argv: list[str], ids: list[str], prompts: list[str]) -> tuple[Costs, dict[str, int]]:
    """The costs of an engine with the replicas' settings, and each prompt's length in its
    tokens."""
    llm = replica_llm(argv)
    try:
        calibration = calibrate(llm, ids, adapters_per_batch=(0, 1, 2, SEATS),
                                batches=(1, 2, 4, 8), repeats=2)  # fmt: skip
        return calibration.costs, {p: len(llm.engine.encode(p)) for p in prompts}
    finally:
        llm.engine.shutdown()


def mean(a: Costs, b: Costs) -> Costs:
    return Costs(**{f.name: (getattr(a, f.name) + getattr(b, f.name)) / 2 for f in fields(Costs)
                    if f.name != "source"})  # fmt: skip


def generate(http: httpx.Client, prompt: str, adapter: str | None, tokens: int,
             tenant: str = "default") -> Answer:  # fmt: skip
    """One request on ``/generate``: its status, its tokens and the seconds to its answer."""
    body = {"inputs": prompt, "parameters": {"max_new_tokens": tokens, "adapter_id": adapter}}
    started = time.perf_counter()
    reply = http.post("/generate", json=body, headers={"X-Tenant-Id": tenant})
    answer = Answer(reply.status_code, seconds=time.perf_counter() - started)
    if reply.status_code == 200:
        answer.generated = int(reply.json()["details"]["generated_tokens"])
    else:
        answer.error = reply.text
    return answer


def closed_loop(url: str, trace: list[TraceRequest]) -> dict[str, Answer]:
    """``CLIENTS`` clients, each sending the trace's next request once its last one is
    answered."""
    pending = iter(trace)
    lock = threading.Lock()
    answers: dict[str, Answer] = {}

    def client() -> None:
        with httpx.Client(base_url=url, timeout=120) as http:
            while True:
                with lock:
                    request = next(pending, None)
                if request is None:
                    return
                r = request
                try:
                    answers[r.id] = generate(http, r.prompt, r.adapter_id, r.max_new_tokens,
                                             r.tenant)  # fmt: skip
                except httpx.HTTPError as exc:
                    answers[r.id] = Answer(error=f"{type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=client) for _ in range(CLIENTS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(600)
    return answers


def warm_up(url: str, prompt: str) -> None:
    """Base-model requests two at a time (one on each replica: the shorter queue), so that
    neither replica's first steps are measured."""
    with httpx.Client(base_url=url, timeout=60) as http:
        for _ in range(3):
            threads = [threading.Thread(target=generate, args=(http, prompt, None, 8))
                       for _ in range(REPLICAS)]  # fmt: skip
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()


def probe(url: str, prompts: list[str]) -> list[float]:
    """Seconds to the answer of one-token base-model requests, one at a time."""
    with httpx.Client(base_url=url, timeout=60) as http:
        answers = [generate(http, prompt, None, 1) for prompt in prompts]
    assert all(a.status == 200 and a.generated == 1 for a in answers)
    return [a.seconds for a in answers]


@dataclass(frozen=True)
class Run:
    loads: int
    p95_ms: float
    overhead_ms: float
    sim: SimResult

    def figures(self) -> str:
        return (f"loads: simulated {self.sim.loads}, real {self.loads}; latency p95: simulated "
                f"{self.sim.latency_p95_ms:.0f} ms, real {self.p95_ms:.0f} ms; fleet overhead "
                f"{self.overhead_ms:.1f} ms a request")  # fmt: skip

    def agrees(self) -> bool:
        return (within(self.sim.loads, self.loads)
                and within(self.sim.latency_p95_ms, self.p95_ms))  # fmt: skip


def within(simulated: float, real: float) -> bool:
    return abs(simulated - real) <= TOLERANCE * real


def run_once(files: tuple[Path, Path], port: int, trace: list[TraceRequest], tag: str) -> Run:
    """The trace on a fresh fleet, calibrated before and after; the same trace simulated."""
    argv = replica_argv(files, port)
    settings = load_settings(argv)
    ids = sorted(p.name for p in files[1].iterdir() if p.is_dir())
    name = f"simulated-fleet-{tag}"
    url = serve_ray.run(argv, REPLICAS, router="lora-guard", app_name=name, replica_cpus=0.5,
                        stats_period_s=STATS_PERIOD_S, route_prefix=f"/{name}")  # fmt: skip
    try:
        warm_up(url, trace[0].prompt)
        prompts = [r.prompt for r in trace]
        before, tokens = calibrated(argv, ids, prompts)
        probes = prompts[:PROBES]
        probe_s = probe(url, probes)
        assert sum(s["loads"] for s in fleet_stats(name)) == 0  # the base model's only
        answers = closed_loop(url, trace)
        loads = sum(s["loads"] for s in fleet_stats(name))
        after, _ = calibrated(argv, ids, prompts)
    finally:
        serve.delete(name)
    assert [k for k, a in answers.items() if a.status != 200] == []
    assert len(answers) == len(trace) and loads > 0
    costs = mean(before, after)
    # The fleet's time outside the engine: each probe's answer less its one prefill step.
    overhead_ms = statistics.mean(1000 * s - costs.step(1, 0, tokens[p])
                                  for s, p in zip(probe_s, probes, strict=True))  # fmt: skip
    requests = [SimRequest(i, r.time, r.adapter_id, tokens[r.prompt], answers[r.id].generated)
                for i, r in enumerate(trace)]  # fmt: skip
    sim = simulate(
        requests, "lora-guard", REPLICAS, SEATS, costs, max_num_seqs=settings.max_num_seqs,
        max_queue=settings.max_concurrent_requests, stats_period_s=STATS_PERIOD_S,
        quantum_s=settings.residency_quantum_ms / 1000, host_slots=settings.max_cpu_loras,
        max_batch_tokens=settings.max_batch_tokens, spread_queue=settings.max_num_seqs,
        clients=CLIENTS, overhead_ms=overhead_ms, stats_tick_s=CONTROL_LOOP_INTERVAL_S,
    )  # fmt: skip
    p95 = percentile([a.seconds * 1000 for a in answers.values()], 95)
    assert p95 is not None and sim.completed == len(trace)
    return Run(loads, p95, overhead_ms, sim)


def test_the_calibrated_simulator_agrees_with_a_real_two_replica_fleet(
    files: tuple[Path, Path], port: int, one_thread: None
) -> None:
    trace = make_trace(SPEC, sorted(p.name for p in files[1].iterdir() if p.is_dir()))
    misses = []
    for attempt in range(ATTEMPTS):
        started = time.perf_counter()
        run = run_once(files, port, trace, str(attempt))
        print(f"{run.figures()} ({time.perf_counter() - started:.0f} s)")
        if run.agrees():
            return
        misses.append(run.figures())
    pytest.fail(f"not within {TOLERANCE:.0%} in {ATTEMPTS} runs: " + "; ".join(misses))
