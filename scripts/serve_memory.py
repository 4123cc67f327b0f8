"""The resident memory of `make serve`: `lora-guard serve` with its defaults (the demo model and its
adapters, prepared if missing), after two requests on two adapters.

    python scripts/serve_memory.py [--requests N]

Prints the server's resident memory (VmRSS) and its peak (VmHWM) from /proc, and the start-up
log's line on how the cache pool was sized. Linux only.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ADAPTERS = ("persona-pirate", "demo-00", "persona-json", "demo-07")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def status_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=2, help="requests, each on its adapter")
    args = parser.parse_args()
    port = free_port()
    log = Path(tempfile.mkdtemp()) / "serve.log"
    command = [sys.executable, "-m", "lora_guard.cli", "serve", "--port", str(port)]
    with log.open("w") as out:
        server = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 1800  # a first run prepares the demo and builds the kernel
        while True:
            if server.poll() is not None:
                print(log.read_text()[-3000:], file=sys.stderr)
                return 1
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError("the server did not start")
            time.sleep(1)
        for i in range(args.requests):
            body = {
                "inputs": "Tell me about the sea.",
                "parameters": {"max_new_tokens": 32, "adapter_id": ADAPTERS[i % len(ADAPTERS)]},
            }
            httpx.post(f"{url}/generate", json=body, timeout=300).raise_for_status()
        rss, peak = status_kib(server.pid, "VmRSS"), status_kib(server.pid, "VmHWM")
        pool = [line for line in log.read_text().splitlines() if "cache pool" in line]
        print(f"lora-guard serve (defaults), after {args.requests} requests:")
        print(f"  resident {rss / 2**20:.2f} GiB, peak {peak / 2**20:.2f} GiB")
        for line in pool:
            print("  " + line.strip())
        return 0
    finally:
        server.terminate()
        server.wait(timeout=60)
        os.unlink(log)


if __name__ == "__main__":
    raise SystemExit(main())
