"""`lora-guard bench --quick`: the real command, every scheme, a real (tiny) model and adapters."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from lora_guard.workload.trace import read_trace

SCHEMES = {"static", "on-demand", "lru", "lora-guard", "lora-guard-observe", "peft"}
# one row a line, as a table reads (fmt: skip)
KEYS = {
    "requests", "completed", "retries", "peak_memory_ratio", "swap_ms_p50", "swap_ms_p95",
    "tail_tokens_per_s", "median_tokens_per_s", "ttft_p50_ms", "ttft_p95_ms", "tokens_per_s",
    "hit_rate", "belady_hit_rate", "cold_load_fail_ratio", "kv_conflicts", "oracle_mismatches",
    "hit_rate_bound", "adapter_wait_ms_p50", "adapter_wait_ms_p95", "decode_tail_tokens_per_s",
    "seeds",
}  # fmt: skip


@pytest.fixture(scope="module")
def quick(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, str, Path]:  # type: ignore[type-arg]
    out = tmp_path_factory.mktemp("bench")
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "lora_guard.cli",
            "bench",
            "--quick",
            "--json",
            str(out / "report.json"),
            "--plots",
            str(out / "plots"),
            "--write-trace",
            str(out / "trace.jsonl"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads((out / "report.json").read_text()), done.stdout, out


@pytest.mark.slow
def test_the_report_holds_every_scheme_with_every_figure(quick: tuple) -> None:  # type: ignore[type-arg]
    report, stdout, out = quick
    schemes = report["schemes"]
    assert set(schemes) == SCHEMES
    shortest = min(r.max_new_tokens for r in read_trace(out / "trace.jsonl"))
    assert shortest >= 2
    for name, summary in schemes.items():
        assert set(summary) >= KEYS, name
        assert summary["requests"] == report["workload"]["requests"] == 32
        assert summary["completed"] == summary["requests"], f"{name} lost requests"
        assert summary["tokens_per_s"] > 0 and summary["tail_tokens_per_s"] > 0
        assert summary["seeds"] == [0]
        # No scheme passes the bound on its own binds from its own start state.
        assert summary["hit_rate"] <= summary["hit_rate_bound"] + 1e-9, name
        assert summary["hit_rate_belady"] <= summary["hit_rate_bound"] + 1e-9, name
        # A request's decode speed leaves out its first token's wait, so it is at least
        # (n - 1) / n of its whole speed; the 5% tails keep that order (every request of the
        # trace generates at least ``shortest`` tokens, none stops at an end token).
        floor = (shortest - 1) / shortest * summary["tail_tokens_per_s"]
        assert summary["decode_tail_tokens_per_s"] >= floor, name
    # Adapter pages live inside the same budget as static's KV pool.
    assert schemes["lora-guard"]["peak_memory_ratio"] <= 1.05
    # The schemes that rotate 8 adapters through 4 slots waited for some of them.
    for name in ("lru", "lora-guard"):
        assert schemes[name]["adapter_wait_ms_p95"] > 0, name
    assert schemes["peft"]["adapter_wait_ms_p95"] == 0  # every adapter loaded before the replay
    # The table printed is the same report, one row per scheme; static is labelled for what it is.
    rows = [line for line in stdout.splitlines() if line.startswith("| ")]
    names = [row.split("|")[1].strip() for row in rows[1:]]
    assert names == ["static (one-instance ceiling)" if n == "static" else n for n in schemes]
    # One static instance per adapter of the trace (8 in --quick).
    static = schemes["static"]
    assert static["fleet_memory_mib"] == pytest.approx(8 * static["peak_memory_mib"])
    assert f"would take {static['fleet_memory_mib']:.0f} MiB" in stdout


@pytest.mark.slow
def test_the_arrival_rate_comes_from_the_measured_capacity(quick: tuple) -> None:  # type: ignore[type-arg]
    report, stdout, _ = quick
    workload = report["workload"]
    capacity = workload["capacity"]
    assert capacity["batch"] == 16 and capacity["requests_per_s"] > 0
    # QUICK_SPEC's bursts: 4x arrivals for 0.5 s out of every 2 s, so the mean is 1.75x the rate.
    assert workload["rate"] * 1.75 == pytest.approx(workload["load"] * capacity["requests_per_s"])
    # Each compass figure the run can tell is printed with its target and verdict.
    compass = report["compass"]
    assert {"tail tok/s vs static", "TTFT p95 vs static", "tok/s vs peft"} <= set(compass)
    for name, figure in compass.items():
        verdicts = {True: "met", False: "missed", None: figure.get("note", "reported")}
        verdict = verdicts[figure["met"]]
        assert (
            f"lora-guard {name}: {figure['value']:.3g}, target {figure['target']}: {verdict}"
            in stdout
        )


@pytest.mark.slow
def test_lora_guard_shares_no_kv_across_adapters_and_matches_the_oracle(quick: tuple) -> None:  # type: ignore[type-arg]
    schemes = quick[0]["schemes"]
    assert schemes["lora-guard"]["kv_conflicts"] == 0
    assert schemes["lora-guard"]["oracle_mismatches"] == 0
    # The same trace with namespaces only observed reuses KV across adapters of a tenant.
    assert schemes["lora-guard-observe"]["kv_conflicts"] > 0


@pytest.mark.slow
def test_the_trace_and_plots_are_written(quick: tuple) -> None:  # type: ignore[type-arg]
    _, _, out = quick
    assert len((out / "trace.jsonl").read_text().splitlines()) == 32
    for name in ("table.png", "latency.png", "hit_rate.png"):
        assert (out / "plots" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_an_unknown_scheme_is_refused_before_anything_runs() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "lora_guard.cli", "bench", "--quick", "--schemes", "lru,magic"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert "unknown scheme 'magic'" in done.stderr


def test_turns_replay_the_trace_again_with_the_schemes_in_the_other_order(
    tmp_path: Path,
) -> None:
    report = tmp_path / "turns.json"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "lora_guard.cli",
            "bench",
            "--quick",
            "--schemes",
            "static,lora-guard",
            "--turns",
            "2",
            "--json",
            str(report),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(report.read_text())
    runs = [(p["seed"], p["turn"], p["order"]) for p in found["per_seed"]]
    assert runs == [(0, 0, ["static", "lora-guard"]), (0, 1, ["lora-guard", "static"])]
    for part in found["per_seed"]:
        assert list(part["schemes"]) == ["static", "lora-guard"]  # reported in the order given
        assert part["schemes"]["lora-guard"]["completed"] == 32
    tail = found["compass"]["tail tok/s vs static"]
    assert len(tail["per_seed"]) == 2 and tail["spread"] == [
        min(tail["per_seed"]),
        max(tail["per_seed"]),
    ]
    assert found["schemes"]["lora-guard"]["completed"] == 64  # both turns' requests
    steps = found["per_seed"][0]["schemes"]["lora-guard"]["steps"]
    assert steps["steps"] > 0 and steps["prefill_tokens"] > 0 and steps["mean_adapters"] > 0
    assert steps["fit_per_prefill_token_ms"] is not None
    assert found["per_seed"][0]["schemes"]["static"]["steps"]["mean_adapters"] == 0
    assert "1 seed x 2 turns" in done.stdout


def test_turns_are_refused_against_a_target_and_must_be_positive() -> None:
    for argv, message in (
        (["--target", "http://127.0.0.1:9", "--turns", "2"], "--turns"),
        (["--quick", "--turns", "0"], "at least 1"),
    ):
        done = subprocess.run(
            [sys.executable, "-m", "lora_guard.cli", "bench", *argv],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 2 and message in done.stderr, done.stderr[-2000:]
