"""Tiny, random, real checkpoints for tests: a Llama model and a byte-level BPE tokenizer.

They are built locally in a second or two, so the fast test suite never needs the demo model.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from lora_guard.clock import monotonic

if TYPE_CHECKING:
    import httpx

Item = TypeVar("Item")
Result = TypeVar("Result")
T = TypeVar("T")

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# The tests' ``tiny_adapters`` fixture: ``(n, prefix, ranks=(4,), **make_adapters kwargs)`` to
# ``{adapter id: folder}``.
AdapterFactory = Callable[..., dict[str, Path]]

_CORPUS = """\
The capital of France is Paris. The capital of Italy is Rome. The capital of Spain is Madrid.
A LoRA adapter changes the attention and projection weights of a base model.
Tenants send requests to one endpoint; each request names an adapter and a prompt.
The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000. Punctuation: , . ; : ! ? ( ) [ ] { } " ' - _ / \\
User: hello. Assistant: hello, how can I help you today? System: you are a helpful assistant.
"""


def make_tiny_tokenizer(out: Path, vocab_size: int = 384, words: Sequence[str] = ()) -> Any:
    """Train a byte-level BPE tokenizer with ChatML special tokens and save it into ``out``.

    ``words`` are learnt whole, as a real model's tokenizer learns common words (the vocabulary
    grows to hold them): text made of them takes about as many tokens as on a real model."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size + 16 * len(words),  # room for each word's merges
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    lines = _CORPUS.splitlines() * 4 + [" ".join(words)] * 64
    tokenizer.train_from_iterator(lines, trainer=trainer)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token="<|endoftext|>",
    )
    wrapped.chat_template = CHATML_TEMPLATE
    wrapped.save_pretrained(out)
    return wrapped


def make_tiny_llama(
    out: Path,
    *,
    seed: int = 0,
    hidden_size: int = 64,
    intermediate_size: int = 128,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    tie_word_embeddings: bool = True,
    initializer_range: float = 0.2,
    tokenizer_words: Sequence[str] = (),
    **config_overrides: Any,
) -> Path:
    """Save a random float32 Llama checkpoint (safetensors + tokenizer + chat template) to ``out``.

    ``initializer_range`` is larger than a trained model's so that greedy decoding has clear
    winners rather than near-ties. ``tokenizer_words``: words its tokenizer learns whole.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    tokenizer = make_tiny_tokenizer(out, words=tokenizer_words)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        max_position_embeddings=config_overrides.pop("max_position_embeddings", 512),
        tie_word_embeddings=tie_word_embeddings,
        initializer_range=initializer_range,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **config_overrides,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(out, safe_serialization=True)
    return out


def reference_greedy(
    model_dir: Path,
    requests: list[tuple[list[int], Path | None]],
    max_new_tokens: int,
    *,
    device: str = "cpu",
    dtype: str = "float32",
) -> list[list[int]]:
    """Greedy tokens from transformers + PEFT (adapter applied unmerged), one request at a time.

    This is the correctness oracle: the engine must produce the same tokens, in float32.
    """
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).to(device)
    results = []
    for prompt, adapter in requests:
        model = base if adapter is None else PeftModel.from_pretrained(base, str(adapter))
        ids = torch.tensor([prompt], device=device)
        with torch.no_grad():
            out = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new_tokens,
                min_new_tokens=max_new_tokens,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
        results.append(out[0, ids.shape[1] :].tolist())
        if adapter is not None:
            base = model.unload()
    return results


def eventually(
    check: Callable[[], T], *, timeout_s: float = 10.0, interval_s: float = 0.05, what: str = ""
) -> T:
    """Call ``check`` every ``interval_s`` until it returns something truthy, and return that;
    after ``timeout_s``, raise AssertionError naming ``what`` and the last value or exception."""
    deadline = monotonic() + timeout_s
    while True:
        try:
            value = check()
            if value:
                return value
            last: object = value
        except Exception as exc:  # tried again until the deadline, then reported
            last = exc
        if monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}: last {last!r}")
        time.sleep(interval_s)


@dataclass
class ServerProcess:
    """A ``lora-guard serve`` started by :func:`start_server`; ``stop`` sends SIGTERM."""

    url: str
    process: subprocess.Popen[str]
    log: Path  # its stdout and stderr

    def stop(self, timeout: float = 30) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def closed_loop(
    url: str,
    items: Sequence[Item],
    send: Callable[[httpx.Client, Item], Result],
    clients: int,
    timeout_s: float = 120.0,
) -> list[Result]:
    """``clients`` HTTP clients of ``url``, each sending the next of ``items`` (``send(http,
    item)``) once its last one is answered; the results in the order of ``items``. An error in
    a client stops the others and is raised here."""
    import httpx

    results: dict[int, Result] = {}
    errors: list[BaseException] = []
    pending, lock = iter(range(len(items))), threading.Lock()

    def client() -> None:
        with httpx.Client(base_url=url, timeout=timeout_s) as http:
            while not errors:
                with lock:
                    i = next(pending, None)
                if i is None:
                    return
                try:
                    results[i] = send(http, items[i])
                except BaseException as exc:  # raised in the caller's thread
                    errors.append(exc)

    threads = [threading.Thread(target=client, daemon=True) for _ in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return [results[i] for i in range(len(items))]


def start_server(
    model: Path,
    adapter_dir: Path,
    *args: str,
    log: Path,
    env: dict[str, str] | None = None,
    command_name: str = "serve",
    ready_s: float = 120,
) -> ServerProcess:
    """Start ``lora-guard serve`` (or ``command_name``, such as ``serve-ray``, which takes the
    same settings) on a free loopback port and wait until ``/health`` is 200.

    ``env`` adds to the environment of the server (``PYTHONPATH`` for a test plugin, say).
    """
    import httpx

    port = free_port()
    command = [
        sys.executable,
        "-m",
        "lora_guard.cli",
        command_name,
        "--model",
        str(model),
        "--adapter-dir",
        str(adapter_dir),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--kv-cache-memory",
        "16MiB",
        "--block-size",
        "4",
        *args,
    ]
    environment = {**os.environ, "LORA_GUARD_DISABLE_PLUGIN_AUTOLOAD": "1", **(env or {})}
    with log.open("w") as handle:
        process = subprocess.Popen(
            command, stdout=handle, stderr=subprocess.STDOUT, text=True, env=environment
        )
    server = ServerProcess(f"http://127.0.0.1:{port}", process, log)
    deadline = monotonic() + ready_s
    while monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode}:\n{log.read_text()}")
        try:
            if httpx.get(server.url + "/health", timeout=2).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    server.stop()
    raise RuntimeError(f"server did not become healthy:\n{log.read_text()}")


def engine_greedy(
    model: Path,
    adapters: dict[str, Path],
    requests: list[tuple[str, str | None]],
    max_new_tokens: int,
) -> list[list[int]]:
    """Greedy tokens of ``(prompt, adapter id)`` requests from an in-process ``lora_guard.LLM``
    (float32, CPU): what a server on the same model and adapters must answer."""
    from lora_guard import LLM, SamplingParams

    table: dict[str, str | Path] = dict(adapters)
    llm = LLM(
        model,
        adapters=table,
        max_loras=max(1, len(adapters)),
        device="cpu",
        dtype="float32",
        kv_cache_memory="16MiB",
        block_size=4,
        policies="lru",
    )
    try:
        outputs = llm.generate(
            [prompt for prompt, _ in requests],
            SamplingParams(max_new_tokens=max_new_tokens),
            adapter_ids=[adapter for _, adapter in requests],
        )
        return [list(out.token_ids) for out in outputs]
    finally:
        llm.engine.shutdown()


class SoloGreedy:
    """Greedy tokens of one request run alone (no other request in its steps, no prefix cache),
    memoised: what a request must get whatever shares its batch. Computed with the per-segment
    loop, so an engine on the kernel is checked against the other computation too. Call
    ``close`` when done."""

    def __init__(self, model: Path, adapters: dict[str, Path], lora_dtype: str = "auto") -> None:
        from lora_guard import LLM

        table: dict[str, str | Path] = dict(adapters)
        self.llm = LLM(
            model,
            adapters=table,
            kv_cache_memory="4MiB",
            policies="lru",
            enable_prefix_caching=False,
            device="cpu",
            dtype="float32",
            lora_dtype=lora_dtype,
            lora_compute="loop",
        )
        self.memo: dict[tuple[tuple[int, ...], str | None, int], list[int]] = {}

    def __call__(self, prompt: list[int], adapter: str | None, n: int) -> list[int]:
        from lora_guard import SamplingParams

        key = (tuple(prompt), adapter, n)
        if key not in self.memo:
            params = SamplingParams(max_new_tokens=n, ignore_eos=True)
            self.memo[key] = self.llm.generate(prompt, params, adapter)[0].token_ids
        return self.memo[key]

    def close(self) -> None:
        self.llm.engine.shutdown()
