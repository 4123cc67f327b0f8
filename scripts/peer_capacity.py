"""Saturated throughput of lora-guard and vLLM's CPU build, each over its own HTTP server, measured
by the same client: vLLM's ``vllm bench serve`` (from ``make peers``), a closed loop of N clients.

    .venv/bin/python scripts/peer_capacity.py --concurrency 16,32 --prompts 96 \
        --json docs/bench/peer-capacity-2026-12-03.json

Systems, one after another on the same machine: ``lora-guard`` (``lora-guard serve`` with the
demo model's adapters), ``vllm`` (started as the bench starts it: ``vllm_launch``, threads bound to
every core, no reserved core, the same KV space) and ``vllm-default`` (the same command without the
thread binding: vLLM's own choice). Every request: random tokens, ``--input-len`` in,
``--output-len`` out with ``ignore_eos``, greedy, the adapter drawn at random from ``--adapters``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from lora_guard.bench.peer_env import PEERS, VLLM_BENCH_SERVE
from lora_guard.bench.replay import EngineOptions
from lora_guard.bench.servers import ServerLaunch, wait_ready
from lora_guard.bench.vllm_peer import BASE_NAME, vllm_launch
from lora_guard.demo.model import prepare_demo
from lora_guard.demo.testing import free_port


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--systems", default="lora-guard,vllm,vllm-default")
    parser.add_argument("--concurrency", default="16,32", help="clients in the closed loop")
    parser.add_argument("--prompts", type=int, default=96, help="requests per run")
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--adapters", default=",".join(f"demo-{i:02d}" for i in range(8)))
    parser.add_argument("--max-loras", type=int, default=8)
    parser.add_argument("--cache-memory", default="768MiB")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    demo = prepare_demo(log=lambda _msg: None)
    adapters = args.adapters.split(",")
    vllm = PEERS["vllm"].make()
    results: list[dict[str, Any]] = []
    for system in args.systems.split(","):
        port = free_port()
        with tempfile.TemporaryDirectory(prefix="peer-capacity-") as scratch:
            log = Path(scratch) / "server.log"
            launch = _launch(system, args, demo.model_dir, demo.adapter_dir, adapters, port, vllm)
            with log.open("wb") as out:
                server = subprocess.Popen(launch.command, stdout=out, stderr=subprocess.STDOUT,
                                          env={**os.environ, **launch.environment},
                                          start_new_session=True)  # fmt: skip
            try:
                url = f"http://127.0.0.1:{port}"
                wait_ready(server, url, log)
                model = BASE_NAME if system.startswith("vllm") else demo.model_dir.name
                for clients in [int(n) for n in args.concurrency.split(",")]:
                    found = _bench(vllm, url, model, demo.model_dir, adapters, clients, args,
                                   Path(scratch))  # fmt: skip
                    shown = launch.as_json()
                    shown["command"] = [
                        a.replace(sys.executable, "python") for a in shown["command"]
                    ]
                    row = {"system": system, "clients": clients, **found, "launch": shown}
                    results.append(row)
                    print(f"{system} N={clients}: {found['output_throughput']:.1f} tok/s, "
                          f"TTFT p50 {found['median_ttft_ms']:.0f} ms, p95 "
                          f"{found['p95_ttft_ms']:.0f} ms, {found['completed']}/{args.prompts} "
                          "done", flush=True)  # fmt: skip
            finally:
                os.killpg(server.pid, 15)
                server.wait(60)
    if args.json:
        command = "python scripts/peer_capacity.py " + " ".join(sys.argv[1:])
        args.json.write_text(json.dumps({"command": command, "runs": results}, indent=2) + "\n")
    return 0


def _launch(
    system: str, args: argparse.Namespace, model: Path, adapter_dir: Path, adapters: list[str],
    port: int, vllm: Path,
) -> ServerLaunch:  # fmt: skip
    if system == "lora-guard":
        command = [sys.executable, "-m", "lora_guard.cli", "serve", "--model", str(model),
                   "--adapter-dir", str(adapter_dir), "--host", "127.0.0.1", "--port", str(port),
                   "--max-loras", str(args.max_loras), "--cache-memory", args.cache_memory,
                   "--dtype", args.dtype]  # fmt: skip
        return ServerLaunch(command, {})
    options = EngineOptions(model=str(model), adapter_dir=str(adapter_dir),
                            max_loras=args.max_loras, kv_cache_memory=args.cache_memory,
                            dtype=args.dtype, max_num_seqs=64)  # fmt: skip
    launch = vllm_launch(vllm, options, adapters, port)
    if system == "vllm-default":  # vLLM's own thread binding: on 2 cores it reserves one
        return ServerLaunch(launch.command, {})
    return launch


def _bench(
    python: Path, url: str, model: str, tokenizer: Path, adapters: list[str], clients: int,
    args: argparse.Namespace, scratch: Path,
) -> dict[str, Any]:  # fmt: skip
    name = f"result-{clients}.json"
    command = [
        str(python), "-c", VLLM_BENCH_SERVE, "--backend", "openai", "--base-url", url,
        "--model", model, "--tokenizer", str(tokenizer), "--dataset-name", "random",
        "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
        "--num-prompts", str(args.prompts), "--max-concurrency", str(clients),
        "--request-rate", "inf", "--ignore-eos", "--temperature", "0", "--seed", "0",
        "--lora-modules", *adapters, "--num-warmups", str(len(adapters)),
        "--percentile-metrics", "ttft,tpot,e2el", "--metric-percentiles", "50,95",
        "--save-result", "--result-dir", str(scratch), "--result-filename", name,
        "--disable-tqdm",
    ]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise SystemExit(f"vllm bench serve failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    found = json.loads((scratch / name).read_text())
    keep = ("completed", "failed", "duration", "total_output_tokens", "output_throughput",
            "mean_ttft_ms", "median_ttft_ms", "p95_ttft_ms", "median_tpot_ms",
            "p95_e2el_ms")  # fmt: skip
    return {key: found.get(key) for key in keep}


if __name__ == "__main__":
    sys.exit(main())
