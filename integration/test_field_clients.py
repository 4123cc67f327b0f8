"""The field's load generators, unchanged, against a real `lora-guard serve` of the demo model.

Each runs from its own virtual environment (``make peers``), over HTTP on loopback, sends requests
for several adapters, and reads what it measured from its own result file. What it reports must
agree with what the server says on /metrics for the same run: every request succeeded, the
generated tokens are exactly what was asked (``ignore_eos``), and its mean time to first token is
within 20% of the server's ``vllm:time_to_first_token_seconds`` mean. ``make test-clients``.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from dataclasses import astuple, dataclass
from pathlib import Path

import pytest

from lora_guard.bench.peer_env import PEERS, VLLM_BENCH_SERVE, PeerEnv
from lora_guard.demo.model import prepare_demo
from lora_guard.demo.scrape import metric
from lora_guard.demo.testing import ServerProcess, start_server

pytestmark = pytest.mark.clients

ADAPTERS = ("demo-00", "demo-03", "demo-07", "persona-json", "persona-pirate")
PROMPTS, INPUT_LEN, OUTPUT_LEN, RATE = 24, 64, 32, 2.0
TTFT_AGREEMENT = 0.20
FIRST_TTFT_S = 2.0  # an adapter read and one prefill of a short prompt take under 0.5 s here
OFFLINE = {**os.environ, "HF_HUB_OFFLINE": "1"}  # the tokenizer is the demo model's, on disk


def peer(name: str) -> PeerEnv:
    env = PEERS[name]
    if not env.ready:
        pytest.skip(f"{name}'s environment is not made: run `make peers` ({env.path})")
    return env


@pytest.fixture(scope="module")
def demo_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, Path]]:
    demo = prepare_demo(log=lambda _msg: None)
    log = tmp_path_factory.mktemp("field-clients") / "server.log"
    server = start_server(
        demo.model_dir,
        demo.adapter_dir,
        "--cache-memory",
        "1GiB",
        "--block-size",
        "16",
        log=log,
    )
    yield server, demo.model_dir
    assert server.stop() == 0, log.read_text()


@dataclass(frozen=True)
class ServerCounts:
    """What /metrics says of the requests between two reads."""

    requests: float
    generated: float
    prompt_tokens: float
    ttft_sum_s: float
    ttft_count: float

    @classmethod
    def read(cls, url: str) -> ServerCounts:
        return cls(
            requests=metric(url, "tgi_request_success"),
            generated=metric(url, "tgi_request_generated_tokens_sum"),
            prompt_tokens=metric(url, "tgi_request_input_length_sum"),
            ttft_sum_s=metric(url, "vllm:time_to_first_token_seconds_sum"),
            ttft_count=metric(url, "vllm:time_to_first_token_seconds_count"),
        )

    def __sub__(self, before: ServerCounts) -> ServerCounts:
        return ServerCounts(*(a - b for a, b in zip(astuple(self), astuple(before), strict=True)))

    @property
    def mean_ttft_ms(self) -> float:
        return 1000 * self.ttft_sum_s / self.ttft_count


def report(client: str, ttft_ms: float, served: ServerCounts) -> None:
    """One line for the log (``make test-clients`` shows it): the client's and the server's TTFT."""
    print(
        f"{client}: {served.requests:.0f} requests, {served.generated:.0f} tokens generated; "
        f"mean TTFT {ttft_ms:.1f} ms, the server's {served.mean_ttft_ms:.1f} ms "
        f"({ttft_ms / served.mean_ttft_ms:.3f}x)"
    )


def within(client_ms: float, server_ms: float) -> bool:
    return abs(client_ms - server_ms) <= TTFT_AGREEMENT * server_ms


def test_vllm_bench_serve(demo_server: tuple[ServerProcess, Path], tmp_path: Path) -> None:
    python = peer("vllm").python
    server, model_dir = demo_server
    before = ServerCounts.read(server.url)
    command = [
        str(python),
        "-c",
        VLLM_BENCH_SERVE,
        "--backend",
        "openai",
        "--base-url",
        server.url,
        "--model",
        "SmolLM2-135M-Instruct",
        "--tokenizer",
        str(model_dir),
        "--dataset-name",
        "random",
        "--random-input-len",
        str(INPUT_LEN),
        "--random-output-len",
        str(OUTPUT_LEN),
        "--num-prompts",
        str(PROMPTS),
        "--request-rate",
        str(RATE),
        "--ignore-eos",
        "--temperature",
        "0",
        "--seed",
        "0",
        "--lora-modules",
        *ADAPTERS,
        "--save-result",
        "--result-dir",
        str(tmp_path),
        "--result-filename",
        "result.json",
        "--disable-tqdm",
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, env=OFFLINE)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads((tmp_path / "result.json").read_text())
    served = ServerCounts.read(server.url) - before

    assert (result["completed"], result["failed"]) == (PROMPTS, 0)
    assert result["total_output_tokens"] == PROMPTS * OUTPUT_LEN
    assert served.requests == PROMPTS
    assert served.generated == result["total_output_tokens"]
    assert served.prompt_tokens == result["total_input_tokens"]  # the bench reads our usage
    report("vllm bench serve", result["mean_ttft_ms"], served)
    assert within(result["mean_ttft_ms"], served.mean_ttft_ms)


def test_guidellm(demo_server: tuple[ServerProcess, Path], tmp_path: Path) -> None:
    """guidellm's chat route (its default) on one adapter, at a constant rate, after vLLM's bench
    on the same server.

    Not guidellm's Poisson profile: in 0.8.1 its workers may read the shared arrival offset before
    the main process sets it (``AsyncPoissonStrategy.init_processes_start`` publishes the start
    time first), schedule from the placeholder -1.0 and send every request at once; the server
    then prefilled all 24 in one 2.2 s step, and both sides reported a mean TTFT of 2.4 s."""
    guidellm = peer("guidellm").path / "bin" / "guidellm"
    server, model_dir = demo_server
    before = ServerCounts.read(server.url)
    out = tmp_path / "guidellm.json"
    command = [
        str(guidellm),
        "run",
        "--backend",
        f"kind=openai_http,target={server.url},model={ADAPTERS[-1]}",
        "--profile",
        f"kind=constant,rate={RATE}",
        "--constraint",
        f"kind=max_requests,count={PROMPTS}",
        "--data",
        f"kind=synthetic_text,prompt_tokens={INPUT_LEN},output_tokens={OUTPUT_LEN}",
        "--tokenizer",
        f"kind=hf_auto,model={model_dir}",
        "--seed",
        "kind=static,value=0",
        "--output",
        f"kind=json,path={out}",
        "--disable-progress",
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, env=OFFLINE)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    benchmark = json.loads(out.read_text())["benchmarks"][0]
    metrics = benchmark["metrics"]
    served = ServerCounts.read(server.url) - before
    sent = sorted(
        (r["info"]["timings"] for r in benchmark["requests"]["successful"]),
        key=lambda t: t["request_start"],
    )
    span = sent[-1]["request_start"] - sent[0]["request_start"]
    assert span >= 0.5 * (len(sent) - 1) / RATE, f"guidellm sent its requests in {span:.2f} s"
    first_ttft_s = sent[0]["first_token_iteration"] - sent[0]["request_start"]
    assert first_ttft_s < FIRST_TTFT_S, "the first request after another client's run waited"

    totals = metrics["request_totals"]
    assert (totals["errored"], totals["incomplete"]) == (0, 0)
    # guidellm 0.8.1 may leave one request out of its report: one it cancelled unsent at its
    # max_requests stop, or one whose completion its scheduler took for a duplicate (the server
    # served it). What it reports must have succeeded; the server served that, and at most the
    # rest, each with exactly the tokens asked.
    successful = totals["successful"]
    assert PROMPTS - 1 <= successful <= PROMPTS
    assert metrics["output_token_count"]["successful"]["total_sum"] == successful * OUTPUT_LEN
    assert successful <= served.requests <= PROMPTS
    assert served.generated == served.requests * OUTPUT_LEN
    if served.requests == successful:
        prompts = metrics["prompt_token_count"]["successful"]["total_sum"]
        assert served.prompt_tokens == prompts
    ttft_ms = metrics["time_to_first_token_ms"]["successful"]["mean"]
    report("guidellm", ttft_ms, served)
    assert within(ttft_ms, served.mean_ttft_ms)
