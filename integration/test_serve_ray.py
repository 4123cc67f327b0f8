"""lora-guard on Ray Serve: two engine replicas of the tiny model behind the adapter-affinity
router, a seeded skewed trace replayed by four concurrent clients over real HTTP.

Every answer must be the oracle's (``bench.oracle``: each request's greedy tokens with no KV
shared). Adapter loads are the replicas' own count (``routing_stats()["loads"]``), compared with
the offline best for the trace (``offline_best_loads``: Belady over the pooled seats of both
replicas, a lower bound for any router). Ray Serve's default router (power of two choices with
its multiplexed ranking) replays the same trace on a fresh deployment in the same test, and its
loads are printed beside ours. Run ``pytest integration/test_serve_ray.py -s`` for the figures.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import httpx
import pytest

from lora_guard.bench.oracle import OracleRequest, oracle_tokens
from lora_guard.bench.replay import EngineOptions
from lora_guard.demo.adapters import make_adapters
from lora_guard.demo.testing import closed_loop, eventually
from lora_guard.workload.stats import percentile
from lora_guard.workload.trace import TraceRequest, WorkloadSpec, make_trace

ray = pytest.importorskip("ray", reason="needs lora-guard[ray]")
serve = pytest.importorskip("ray.serve")

from lora_guard import serve_ray  # noqa: E402
from lora_guard.serve_ray.app import fleet_stats  # noqa: E402
from lora_guard.workload.bounds import offline_best_loads  # noqa: E402

REPLICAS, SEATS, CLIENTS = 2, 3, 4
SPEC = WorkloadSpec(
    adapters=6,
    tenants=2,
    requests=48,
    zipf=1.0,
    seed=3,
    system_prompt_words=12,
    user_words_mean=6,
    output_mean=10,
    output_min=4,
    output_max=20,
)
ROUTER_BOUND = 1.1  # our loads over the offline best
# More adapters than pooled seats: the replicas must evict, and the pooled optimum (one cache of
# six seats with all of the future in view) is out of reach of replicas that each evict for
# themselves. With the router expecting the adapter it routed to a full replica least recently to
# leave, 1.18x to 1.91x in 18 runs (median 1.45x); without, 1.09x to 2.18x in 11 (median 1.73x).
# Ray's default router: 1.36x to 2.64x.
MORE = replace(SPEC, adapters=10, requests=60)
MORE_BOUND = 2.2


@dataclass
class Answer:
    status: int = 0
    tokens: list[int] = field(default_factory=list)
    error: str | None = None
    seconds: float = 0.0


@dataclass
class Fleet:
    url: str
    app_name: str
    model: Path
    adapters: Path


@pytest.fixture(scope="module")
def fleet_files(
    tiny: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, Path]:
    model, _ = tiny
    adapters = tmp_path_factory.mktemp("fleet-adapters")
    make_adapters(model, adapters, n=MORE.adapters, ranks=(4, 8), strength=0.5, prefix="f")
    return model, adapters


def deploy(
    files: tuple[Path, Path],
    port: int,
    router: str,
    route_prefix: str = "/",
    replicas: int = REPLICAS,
    *more: str,
) -> Fleet:
    model, adapters = files
    argv = [
        "--model",
        str(model),
        "--adapter-dir",
        str(adapters),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--kv-cache-memory",
        "16MiB",
        "--block-size",
        "4",
        "--max-loras",
        str(SEATS),
        *more,
    ]
    name = f"lora-guard{route_prefix.replace('/', '-')}".rstrip("-")
    url = serve_ray.run(
        argv,
        replicas,
        router=router,
        app_name=name,
        replica_cpus=0.5,
        stats_period_s=0.5,
        route_prefix=route_prefix,
    )
    return Fleet(url, name, model, adapters)


@pytest.fixture(scope="module")
def fleet(fleet_files: tuple[Path, Path], ray_port: int) -> Iterator[Fleet]:
    """The adapter-affinity router's deployment (deleted at the end of the module)."""
    running = deploy(fleet_files, ray_port, "lora-guard")
    yield running
    serve.delete(running.app_name)


def trace_of(spec: WorkloadSpec, adapters: Path) -> list[TraceRequest]:
    return make_trace(spec, sorted(p.name for p in adapters.iterdir() if p.is_dir()))


def oracle_of(files: tuple[Path, Path], trace: list[TraceRequest]) -> dict[str, list[int]]:
    """The oracle's tokens per request id, batched, and alone under ``solo:ID``."""
    model, adapters = files
    options = EngineOptions(model=str(model), adapter_dir=str(adapters), kv_cache_memory="16MiB")
    wanted = [
        OracleRequest(r.id, r.prompt, r.adapter_id, r.max_new_tokens, ignore_eos=False)
        for r in trace
    ]
    table = oracle_tokens(wanted, options)
    return {**table, **{f"solo:{k}": v for k, v in oracle_tokens(wanted, options, True).items()}}


@pytest.fixture(scope="module")
def trace(fleet: Fleet) -> list[TraceRequest]:
    return trace_of(SPEC, fleet.adapters)


@pytest.fixture(scope="module")
def oracle(fleet_files: tuple[Path, Path], trace: list[TraceRequest]) -> dict[str, list[int]]:
    return oracle_of(fleet_files, trace)


def stream(client: httpx.Client, request: TraceRequest) -> Answer:
    """One request on /generate_stream, as a TGI client sends it: its status and tokens."""
    answer = Answer()
    parameters = {"max_new_tokens": request.max_new_tokens, "adapter_id": request.adapter_id}
    body = {"inputs": request.prompt, "parameters": parameters}
    started = time.perf_counter()
    with client.stream(
        "POST", "/generate_stream", json=body, headers={"X-Tenant-Id": request.tenant}
    ) as reply:
        answer.status = reply.status_code
        if reply.status_code != 200:
            answer.error = reply.read().decode()
        for line in reply.iter_lines() if reply.status_code == 200 else ():
            if line.startswith("data:"):
                event = json.loads(line[5:])
                if "error" in event:
                    answer.error = str(event["error"])
                else:
                    answer.tokens.append(int(event["token"]["id"]))
    answer.seconds = time.perf_counter() - started
    return answer


def replay(url: str, trace: list[TraceRequest]) -> dict[str, Answer]:
    """``CLIENTS`` clients, each sending the next request of the trace once its last one is
    answered (closed loop)."""

    def answer(http: httpx.Client, request: TraceRequest) -> Answer:
        try:
            return stream(http, request)
        except httpx.HTTPError as exc:
            return Answer(error=f"{type(exc).__name__}: {exc}")

    return dict(zip((r.id for r in trace), closed_loop(url, trace, answer, CLIENTS), strict=True))


def wrong(answers: dict[str, Answer], oracle: dict[str, list[int]]) -> list[str]:
    """Requests without the oracle's tokens (batched, else alone)."""
    return [
        key
        for key, a in answers.items()
        if a.status != 200
        or a.error is not None
        or a.tokens not in (oracle[key], oracle[f"solo:{key}"])
    ]


def fresh_run(
    files: tuple[Path, Path], port: int, router: str, trace: list[TraceRequest], tag: str = ""
) -> tuple[int, dict[str, Answer]]:
    """Adapter loads and answers of ``trace`` on a fresh deployment behind ``router``."""
    fleet = deploy(files, port, router, f"/{router}{tag}")
    try:
        answers = replay(fleet.url, trace)
        return sum(s["loads"] for s in fleet_stats(fleet.app_name)), answers
    finally:
        serve.delete(fleet.app_name)


def figures(
    trace: list[TraceRequest],
    ours: int,
    ray_default: int,
    best: int,
    answers: dict[str, Answer],
    default_answers: dict[str, Answer],
    started: float,
) -> str:
    def p95(of: dict[str, Answer]) -> float:
        return percentile([a.seconds * 1000 for a in of.values()], 95) or 0.0

    return (
        f"\n{len(trace)} requests, {len({r.adapter_id for r in trace} - {None})} adapters, "
        f"{REPLICAS} replicas x {SEATS} seats, {CLIENTS} clients: adapter loads: "
        f"lora-guard router {ours}, Ray default router {ray_default}, offline best {best} "
        f"(ours {ours / best:.2f}x, Ray default {ray_default / best:.2f}x); request p95 "
        f"{p95(answers):.0f} ms (lora-guard), {p95(default_answers):.0f} ms (Ray default); "
        f"{time.perf_counter() - started:.0f} s"
    )


def test_a_skewed_trace_from_four_clients_is_correct_and_loads_near_the_offline_best(
    fleet: Fleet,
    fleet_files: tuple[Path, Path],
    ray_port: int,
    trace: list[TraceRequest],
    oracle: dict[str, list[int]],
) -> None:
    # First in the module: the fleet has served nothing yet.
    assert sum(s["loads"] for s in fleet_stats(fleet.app_name)) == 0
    started = time.perf_counter()
    best = offline_best_loads([r.adapter_id for r in trace], REPLICAS, SEATS)
    answers = replay(fleet.url, trace)
    ours = sum(s["loads"] for s in fleet_stats(fleet.app_name))
    assert len(answers) == len(trace)
    assert wrong(answers, oracle) == []

    # Ray Serve's default router on a fresh deployment of its own, beside ours (idle now).
    ray_default, default_answers = fresh_run(fleet_files, ray_port, "ray-default", trace)
    print(figures(trace, ours, ray_default, best, answers, default_answers, started))
    assert wrong(default_answers, oracle) == []  # both routers serve correct answers
    assert best <= ours <= ROUTER_BOUND * best


def test_openai_routes_and_bad_requests_through_the_ingress(fleet: Fleet) -> None:
    prompt = "The capital of France is"
    tgi = httpx.post(
        fleet.url + "/generate",
        timeout=60,
        json={"inputs": prompt, "parameters": {"max_new_tokens": 6, "adapter_id": "f-01"}},
    )
    assert tgi.status_code == 200, tgi.text
    completion = httpx.post(
        fleet.url + "/v1/completions",
        timeout=60,
        json={"model": "f-01", "prompt": prompt, "max_tokens": 6},
    )
    assert completion.status_code == 200, completion.text
    assert completion.json()["choices"][0]["text"] == tgi.json()["generated_text"]
    chat = httpx.post(
        fleet.url + "/v1/chat/completions",
        json={
            "model": "f-02",
            "messages": [{"role": "user", "content": "hello"}],
            "max_tokens": 4,
        },
        timeout=60,
    )
    assert chat.status_code == 200 and chat.json()["choices"][0]["message"]["role"] == "assistant"
    unknown = httpx.post(
        fleet.url + "/generate",
        json={"inputs": "x", "parameters": {"adapter_id": "no-such-adapter"}},
        timeout=60,
    )
    assert unknown.status_code == 422 and "no-such-adapter" in unknown.json()["error"]
    broken = httpx.post(
        fleet.url + "/generate",
        content=b"{not json",
        timeout=60,
        headers={"content-type": "application/json"},
    )
    assert broken.status_code == 422
    admin = httpx.post(fleet.url + "/v1/adapters/f-01/pin", timeout=60)
    assert admin.status_code == 501 and "one replica" in admin.json()["error"]
    assert httpx.get(fleet.url + "/health", timeout=60).status_code == 200
    info = httpx.get(fleet.url + "/info", timeout=60).json()
    assert info["router"] == "lora-guard"


def test_the_fleets_metrics_agree_with_the_replicas_own(fleet: Fleet) -> None:
    """The fleet's hit rate and cold-fail ratio are what the replicas' summed counters give,
    within 0 to 1; counters are the replicas' sums; per-replica gauges keep a ``replica``
    label (one series per replica, each the replica's own value)."""
    from prometheus_client.parser import text_string_to_metric_families

    def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        return {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text)
            for s in f.samples
        }

    for adapter in ("f-03", "f-03", "f-03", "f-04"):  # hot lookups on one replica at least
        body = {"inputs": "Hello", "parameters": {"max_new_tokens": 2, "adapter_id": adapter}}
        assert httpx.post(fleet.url + "/generate", json=body, timeout=60).status_code == 200
    fleet_text = httpx.get(fleet.url + "/metrics", timeout=60).text
    stats = fleet_stats(fleet.app_name)
    assert len(stats) == REPLICAS
    ours, theirs = samples(fleet_text), [samples(s["metrics"]) for s in stats]

    def summed(name: str, **only: set[str]) -> float:
        """The replicas' samples of ``name`` whose labels take the values ``only`` names."""
        return sum(
            v
            for one in theirs
            for (n, labels), v in one.items()
            if n == name and all(dict(labels).get(k) in vs for k, vs in only.items())
        )

    lookups = summed("lora_guard_adapter_lookups_total")
    hot = summed("lora_guard_adapter_lookups_total", result={"hot"})
    assert lookups >= 4 and ours["lora_guard_adapter_lookups_total", (("result", "hot"),)] == hot
    hit_rate = ours["lora_guard_hot_adapter_hit_rate", ()]
    assert hit_rate == hot / lookups
    cold = summed("lora_guard_cold_loads_total")
    failed = summed("lora_guard_cold_loads_total", outcome={"rejected", "failed"})
    fail_ratio = ours["lora_guard_cold_load_fail_ratio", ()]
    assert fail_ratio == (failed / cold if cold else 0.0)
    assert 0 <= hit_rate <= 1 and 0 <= fail_ratio <= 1
    labelled = {
        dict(labels)["replica"]: v
        for (n, labels), v in ours.items()
        if n == "vllm:num_requests_running"
    }
    assert len(labelled) == REPLICAS
    assert sorted(labelled.values()) == sorted(
        one["vllm:num_requests_running", ()] for one in theirs
    )
    info = [labels for (n, labels), _ in ours.items() if n == "vllm:lora_requests_info"]
    assert len({dict(labels)["replica"] for labels in info}) == REPLICAS  # told apart


def aborted(fleet: Fleet) -> float:
    """Requests the replicas aborted (``tgi_request_failure{err="abort"}``), summed."""
    prefix = 'tgi_request_failure{err="abort"} '
    return sum(
        float(line.removeprefix(prefix))
        for s in fleet_stats(fleet.app_name)
        for line in s["metrics"].splitlines()
        if line.startswith(prefix)
    )


def test_a_client_that_disconnects_mid_stream_aborts_its_request_in_the_engine(
    fleet: Fleet,
) -> None:
    before = aborted(fleet)
    body = {"inputs": "hi", "parameters": {"max_new_tokens": 480, "adapter_id": "f-00"}}
    with httpx.stream("POST", fleet.url + "/generate_stream", json=body, timeout=60) as reply:
        assert reply.status_code == 200
        events = 0
        for line in reply.iter_lines():
            events += line.startswith("data:")
            if events == 3:
                break  # the client goes away after three tokens
    eventually(
        lambda: aborted(fleet) != before, timeout_s=30, what="the engine to abort the request"
    )
    assert aborted(fleet) == before + 1
    assert all(s["queue"] == 0 for s in fleet_stats(fleet.app_name))


def test_bench_target_replays_against_the_fleet(fleet: Fleet, tmp_path: Path) -> None:
    report_path = tmp_path / "report.json"
    loads_before = sum(s["loads"] for s in fleet_stats(fleet.app_name))
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "lora_guard.cli",
            "bench",
            "--target",
            fleet.url,
            "--adapters",
            "6",
            "--tenants",
            "2",
            "--requests",
            "12",
            "--rate",
            "6",
            "--output-mean",
            "10",
            "--system-prompt-words",
            "12",
            "--user-words",
            "6",
            "--model",
            str(fleet.model),
            "--adapter-dir",
            str(fleet.adapters),
            "--json",
            str(report_path),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    target = json.loads(report_path.read_text())["schemes"]["target"]
    assert target["requests"] == target["completed"] == 12
    assert target["oracle_mismatches"] == 0
    # The fleet's /metrics sum both replicas' counters: the swaps it shows are the replicas' loads.
    loads = sum(s["loads"] for s in fleet_stats(fleet.app_name)) - loads_before
    assert target["swaps"] == loads and target["hit_rate"] is not None


def test_with_api_keys_the_fleet_checks_them_and_its_metrics_need_an_admin_key(
    fleet_files: tuple[Path, Path], ray_port: int, tmp_path: Path
) -> None:
    keys = tmp_path / "keys.toml"
    keys.write_text(
        '[keys.app]\nkey = "app-secret-key"\ntenant = "acme"\n'
        '[keys.ops]\nkey = "ops-secret-key"\nadmin = true\n'
    )
    keyed = deploy(fleet_files, ray_port, "lora-guard", "/keyed", 1, "--api-key-file", str(keys))
    try:
        body = {"inputs": "hello", "parameters": {"max_new_tokens": 2, "adapter_id": "f-00"}}
        assert httpx.post(keyed.url + "/generate", json=body, timeout=60).status_code == 401
        app = {"Authorization": "Bearer app-secret-key"}
        ops = {"Authorization": "Bearer ops-secret-key"}
        assert (
            httpx.post(keyed.url + "/generate", json=body, headers=app, timeout=60).status_code
            == 200
        )
        assert httpx.get(keyed.url + "/metrics", headers=app, timeout=60).status_code == 403
        metrics = httpx.get(keyed.url + "/metrics", headers=ops, timeout=60)
        assert metrics.status_code == 200 and "lora_guard_adapter_lookups_total" in metrics.text
    finally:
        serve.delete(keyed.app_name)


def test_with_more_adapters_than_seats_every_answer_is_right_and_loads_stay_bounded(
    fleet_files: tuple[Path, Path], ray_port: int
) -> None:
    trace = trace_of(MORE, fleet_files[1])
    oracle = oracle_of(fleet_files, trace)
    started = time.perf_counter()
    best = offline_best_loads([r.adapter_id for r in trace], REPLICAS, SEATS)
    ours, answers = fresh_run(fleet_files, ray_port, "lora-guard", trace, "-more")
    ray_default, default_answers = fresh_run(fleet_files, ray_port, "ray-default", trace, "-more")
    print(figures(trace, ours, ray_default, best, answers, default_answers, started))
    assert wrong(answers, oracle) == [] and wrong(default_answers, oracle) == []
    assert ours <= MORE_BOUND * best
