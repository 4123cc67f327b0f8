"""The capacity sweep: its knee, its throughput read while every client is busy, targets that
can miss, llama.cpp's launch, and the whole command on two real servers (lora-guard's and the
PEFT server) over loopback HTTP."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lora_guard.bench.arguments import add_arguments, workload_spec
from lora_guard.bench.llama_cpp_peer import SLOT_TOKENS, llama_cpp_launch
from lora_guard.bench.load import RequestRecord, busy_throughput
from lora_guard.bench.servers import ServerLaunch, paused, start_server, stop_server
from lora_guard.bench.sweep import (
    Point,
    SweepTraces,
    cache_hit_rate,
    knee,
    next_clients,
    saturated,
)
from lora_guard.bench.sweep_report import main as summarize_runs
from lora_guard.bench.sweep_report import runs_summary, sweep_targets, target_lines
from lora_guard.bench.systems import SYSTEMS, by_lora_list
from lora_guard.demo.testing import AdapterFactory
from lora_guard.workload.trace import TraceRequest


def point(clients: int, tokens_per_s: float, ttft_p95_ms: float = 100.0) -> Point:
    return Point(
        clients, 10, 10, 0, 0, tokens_per_s, tokens_per_s / 10, 1.0, 50.0, ttft_p95_ms, 1e3
    )


def test_the_knee_is_the_fewest_clients_near_the_best() -> None:
    points = [point(1, 10), point(2, 19), point(4, 30), point(8, 31), point(16, 29)]
    assert saturated(points).clients == 8
    assert knee(points).clients == 4  # 30 >= 0.95 x 31


def test_no_point_sends_a_prompt_the_server_has_served_before() -> None:
    # the sweep as `lora-guard bench --sweep 1,2,4,8,16,32,64` draws it, then two more points
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--sweep", "1,2,4,8,16,32,64"])
    adapters = [f"demo-{i:02d}" for i in range(args.adapters)]
    traces = SweepTraces(workload_spec(args), adapters, args.requests)
    points = [traces.point(n) for n in [*args.sweep, 128, 256]]
    sent = [r.prompt for trace in points for r in trace]
    assert len(sent) == len(set(sent))  # no whole prompt twice, within a point or across
    assert [len(t) for t in points] == [max(args.requests, 3 * n) for n in [*args.sweep, 128, 256]]
    # the tenants' system prompts are still shared, as prefix caches are for
    firsts = {r.prompt.split("\n", 1)[0] for trace in points for r in trace}
    assert len(firsts) <= args.tenants


def test_the_sweep_goes_on_while_the_throughput_still_rises() -> None:
    rising = [point(16, 100), point(32, 120)]
    assert next_clients(rising, limit=128) == 64
    assert next_clients([*rising, point(64, 124)], limit=128) is None  # within 5%: flat
    assert next_clients([point(32, 100), point(64, 90)], limit=128) is None  # falling
    assert next_clients([point(32, 100), point(64, 150)], limit=64) is None  # at the limit


def test_the_machine_is_measured_with_the_server_stopped(tmp_path: Path) -> None:
    """A server that spins while idle (as vLLM's CPU worker does) gets no CPU while the
    machine's speed is measured beside it, and runs again after."""
    spin = ServerLaunch([sys.executable, "-c", "while True: pass"], {})
    server = start_server(spin, tmp_path / "spin.log")
    try:

        def cpu_s() -> float:
            fields = Path(f"/proc/{server.pid}/stat").read_text().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

        time.sleep(0.5)
        with paused(server):
            time.sleep(0.1)  # the stop lands
            before = cpu_s()
            time.sleep(0.5)
            assert cpu_s() - before < 0.02
        before, deadline = cpu_s(), time.monotonic() + 5
        while cpu_s() - before < 0.1 and time.monotonic() < deadline:
            time.sleep(0.1)  # running again (on a busy machine, it gets what it gets)
        assert cpu_s() - before >= 0.1
        assert server.poll() is None
    finally:
        stop_server(server)


def test_the_prefix_cache_hit_rate_is_read_between_two_readings() -> None:
    assert cache_hit_rate((100.0, 400.0), (160.0, 500.0)) == pytest.approx(0.6)
    assert cache_hit_rate(None, (1.0, 2.0)) is None  # the server has no such counters
    assert cache_hit_rate((1.0, 2.0), (1.0, 2.0)) is None  # no prompt sent


def _sent(
    id: str, sent: float, first: float, finish: float, usage: int, chunks: list[float]
) -> RequestRecord:
    """A request sent at ``sent`` whose answer came in ``chunks`` and counted ``usage`` tokens."""
    return RequestRecord(id, None, sent, first, finish, sent=sent, chunks=chunks, usage=usage)


def test_throughput_is_read_while_every_client_is_busy() -> None:
    # two clients; the last request is sent at 2 s, the stragglers drain until 10 s
    replies = [
        _sent("a", 0.0, 0.1, 1.0, usage=4, chunks=[0.25, 0.5, 0.75, 1.0]),
        _sent("b", 0.0, 0.1, 2.0, usage=4, chunks=[0.5, 1.0, 1.5, 2.0]),
        _sent("c", 1.0, 1.1, 10.0, usage=4, chunks=[2.5, 5.0, 7.5, 10.0]),
        _sent("d", 2.0, 2.1, 10.0, usage=2, chunks=[6.0, 10.0]),
    ]
    tokens_per_s, busy = busy_throughput(replies, clients=2)
    assert busy == 2.0
    assert tokens_per_s == pytest.approx(8 / 2.0)  # a and b's tokens; c's first comes later


def test_a_chunk_count_is_scaled_to_the_servers_token_count() -> None:
    # a server whose last chunk only says "finished": 3 chunks, 2 tokens
    reply = _sent("a", 0.0, 0.1, 1.0, usage=2, chunks=[0.1, 0.5, 1.0])
    assert reply.tokens_by(0.5) == pytest.approx(2 * 2 / 3)
    assert reply.tokens_by(1.0) == 2


def _at_one(tokens_per_s: float) -> dict[str, float]:
    return {"clients": 1, "tokens_per_s": tokens_per_s}


def test_targets_built_to_miss_print_missed() -> None:
    systems = {
        "lora-guard": {"saturated": {"tokens_per_s": 20.0}, "matched": {"ttft_p95_ms": 80.0}},
        "vllm": {"saturated": {"tokens_per_s": 10.0}, "matched": {"ttft_p95_ms": 100.0}},
    }
    lines = target_lines(sweep_targets(systems))
    assert lines == [
        "saturated tok/s vs vllm: 2x (target >= 3x): missed",
        "TTFT p95 at matched load vs vllm: 0.8x (target <= 0.5x): missed",
    ]
    systems["vllm"] = {"saturated": {"tokens_per_s": 5.0}, "matched": {"ttft_p95_ms": 200.0}}
    assert all(line.endswith(": met") for line in target_lines(sweep_targets(systems)))
    one_client = {
        "lora-guard": {"saturated": {"tokens_per_s": 30.0}, "points": [_at_one(5.0)]},
        "llama.cpp": {"saturated": {"tokens_per_s": 10.0}, "points": [_at_one(10.0)]},
    }
    assert target_lines(sweep_targets(one_client)) == [
        "saturated tok/s vs llama.cpp: 3x (target >= 1.5x): met",
        "tok/s at one client vs llama.cpp: 0.5x (target >= 1x): missed",
    ]
    systems["lora-guard"]["saturated"]["machine_share"] = 0.1  # a share, not a ratio: no "x"
    assert target_lines(sweep_targets(systems))[0] == (
        "saturated tok/s x FLOPs a token over the machine's matrix rate: 0.1 (target >= 0.5): "
        "missed"
    )


def _run(ours: float, vllm: float, reserved: float, llama_at_one: float) -> dict[str, object]:
    saturated = {"lora-guard": ours, "vllm": vllm, "vllm-reserved": reserved, "llama.cpp": 10.0}
    at_one = {"lora-guard": 12.0, "llama.cpp": llama_at_one}
    return {
        "systems": {
            name: {
                "saturated": {"tokens_per_s": value},
                "points": [_at_one(at_one[name])] if name in at_one else [],
            }
            for name, value in saturated.items()
        }
    }


def test_runs_are_summed_up_as_the_median_of_each_runs_ratio_with_the_range(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    runs = [_run(60, 10, 20, 10.0), _run(90, 30, 10, 15.0), _run(30, 12, 5, 8.0)]
    summary = {entry["what"]: entry for entry in runs_summary(runs)}
    # vLLM's better layout is the faster of its two in each run, then the median over runs
    better = summary["saturated tok/s vs vllm's better layout"]
    assert better["runs"] == [3.0, 3.0, 2.5]
    assert better["median"] == 3.0 and better["range"] == [2.5, 3.0] and better["met"]
    at_one = summary["tok/s at one client vs llama.cpp"]
    assert at_one["runs"] == [1.2, 0.8, 1.5] and at_one["median"] == 1.2 and at_one["met"]
    assert summary["saturated tok/s vs llama.cpp"]["median"] == 6.0
    # a run without a system leaves a gap, not a wrong median
    runs[2]["systems"].pop("vllm-reserved")  # type: ignore[attr-defined]
    assert runs_summary(runs)[-1]["runs"] == [3.0, 3.0, None]
    paths = []
    for i, run in enumerate(runs):
        paths.append(tmp_path / f"run{i}.json")
        paths[-1].write_text(json.dumps(run))
    assert summarize_runs([str(p) for p in paths]) == 0
    out = capsys.readouterr().out
    assert "tok/s at one client vs llama.cpp: 1.2x, 0.8x, 1.5x; median 1.2x (0.8x-1.5x)" in out
    (tmp_path / "bad.json").write_text("[]")
    assert summarize_runs([str(tmp_path / "bad.json")]) == 2


def test_llama_server_gets_a_slot_per_client_every_core_and_every_adapter() -> None:
    adapters = [Path("/g/a.gguf"), Path("/g/b.gguf")]
    launch = llama_cpp_launch(
        Path("/bin/llama-server"), Path("/g/m.gguf"), adapters, 9000, parallel=32, cores={0, 1}
    )
    command = launch.command
    assert command[command.index("--parallel") + 1] == "32"
    assert command[command.index("--ctx-size") + 1] == str(32 * SLOT_TOKENS)
    assert command[command.index("--threads") + 1] == "2"
    assert command[command.index("--lora") + 1] == "/g/a.gguf,/g/b.gguf"
    assert "--lora-init-without-apply" in command  # a request names its own adapter
    body = by_lora_list(["a", "b"])
    ask = TraceRequest("r", 0.0, "t0", "b", "hi", 4)
    assert body(ask)["lora"] == [{"id": 1, "scale": 1.0}]
    # an empty list would mean every adapter at the server's scale: the base is all at 0
    assert body(TraceRequest("r", 0.0, "t0", None, "hi", 4))["lora"] == [{"id": 0, "scale": 0.0}]


@pytest.mark.slow
@pytest.mark.study
def test_one_command_sweeps_lora_guard_and_peft_over_http(
    tiny_model: Path, tiny_adapters: AdapterFactory, tmp_path: Path
) -> None:
    folder = next(iter(tiny_adapters(3, "sweep").values())).parent
    out = tmp_path / "sweep.json"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "lora_guard.cli",
            "bench",
            "--sweep",
            "1,2",
            "--systems",
            "lora-guard,peft",
            "--model",
            str(tiny_model),
            "--adapter-dir",
            str(folder),
            "--adapters",
            "3",
            "--tenants",
            "2",
            "--requests",
            "6",
            "--output-mean",
            "6",
            "--base-share",
            "0.3",  # base-model requests too, by each server's name for it
            "--system-prompt-words",
            "40",  # two blocks a tenant's requests share
            "--user-words",
            "4",
            "--kv-cache-memory",
            "64MiB",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    modules = {"lora-guard": "lora_guard.cli", "peft": "lora_guard.bench.peft_server"}
    for name, module in modules.items():
        found = report["systems"][name]
        clients = [p["clients"] for p in found["points"]]
        assert clients[:2] == [1, 2] and clients[2:] in ([], [4])  # 4 only while still rising
        for p in [*found["points"], found["matched"]]:
            assert p["completed"] == p["requests"] and p["short"] == 0  # all asked tokens came
            assert p["tokens_per_s"] > 0 and p["ttft_p95_ms"] > 0
            assert p["machine_gflops"] > 0  # the machine's speed, measured before the point
            if name == "lora-guard":  # its /metrics says how much of the prompts it had cached
                assert 0 < p["prefix_cache_hit_rate"] < 1
                # and its request log where each request's time went, joined by X-Request-Id
                split = p["time_split"]
                assert split["requests"] == p["completed"] and split["request_ms"] > 0
                parts = ("queue", "step", "between_steps", "http", "client")
                assert sum(split[k] for k in parts) == pytest.approx(1.0)
                assert split["step"] > 0 and all(split[k] >= 0 for k in parts)
            else:
                assert p["prefix_cache_hit_rate"] is None and p["time_split"] is None
        assert found["launch"]["command"][1:3] == ["-m", module]  # how it ran, in the report
        assert out.with_name(f"sweep.{name}-sweep.log").exists()
    assert out.with_name("sweep.lora-guard-requests.log").read_text().count("\n") > 6
    assert report["regime"] == "everything fits: 3 adapters, 3 seats"
    for found in report["systems"].values():
        for p in [*found["points"], found["matched"]]:  # how close to the machine it ran
            assert p["flops_per_token"] > 0 and 0 < p["machine_share"] < 1
    assert [t["what"] for t in report["targets"]] == [
        "saturated tok/s x FLOPs a token over the machine's matrix rate",
        "saturated tok/s vs peft",
        "TTFT p95 at matched load vs peft",
    ]
    assert "| lora-guard | matched load |" in done.stdout
    assert "| machine GFLOP/s | of the machine |" in done.stdout


def test_every_system_the_sweep_names_can_be_started() -> None:
    # a peer's entry names its module's function as text: a typo would show only when run
    for entry in SYSTEMS.values():
        assert callable(entry.start()), entry.name
