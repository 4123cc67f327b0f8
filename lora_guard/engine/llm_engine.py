"""The engine: owns the model, the KV cache, the adapters and the scheduler; runs one step at a
time. Not thread-safe: one thread drives it (``LLM`` directly, ``AsyncEngine`` from its loop)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from lora_guard.engine.config import ConfigError, EngineConfig
from lora_guard.engine.errors import RequestError as RequestError  # re-exported
from lora_guard.engine.errors import UnknownAdapterError
from lora_guard.engine.kv_cache import Block, BlockManager
from lora_guard.engine.lora.checkpoint import LoRAAdapter, read_adapter
from lora_guard.engine.lora.loader import AdapterLoader, HostCache
from lora_guard.engine.lora.pool import CachePool
from lora_guard.engine.lora.registry import AdapterRegistry
from lora_guard.engine.lora.residency import ResidencyManager
from lora_guard.engine.model import LlamaModel
from lora_guard.engine.runner import ModelRunner
from lora_guard.engine.sampling import SamplerInput, SamplingParams, sample
from lora_guard.engine.scheduler import Scheduler
from lora_guard.engine.sequence import FinishReason, Sequence
from lora_guard.plugins.manager import Hooks, make_plugin_manager

MIN_KV_BLOCKS = 4
log = logging.getLogger(__name__)


@dataclass(slots=True)
class RequestOutput:
    """A request's state after a step: everything generated so far."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    logprobs: list[float]
    finished: bool
    finish_reason: str | None
    num_cached_tokens: int = 0
    error: str | None = None
    stop_sequence: str | None = None
    retry_after: float | None = None  # set when a policy answered "busy, retry later"


@dataclass
class EngineStats:
    steps: int = 0
    preemptions: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    step_times: list[float] = field(default_factory=list)


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig,
        adapters: dict[str, str | Path] | None = None,
        adapter_dir: str | Path | None = None,
        hooks: Hooks | None = None,
    ) -> None:
        from transformers import AutoTokenizer

        self.config = config
        self.hooks = hooks if hooks is not None else Hooks(make_plugin_manager())
        model_dir = Path(config.model).expanduser()
        self.model = LlamaModel(model_dir, config.torch_dtype, config.torch_device)
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        spec = self.model.spec
        self.model_id = config.model_id or model_name(model_dir, self.model.config)
        self.eos_token_ids = _eos_ids(self.model.config, self.tokenizer)

        page_bytes = CachePool.page_bytes(spec, config.block_size, config.torch_dtype)
        num_pages = config.cache_bytes() // page_bytes
        merged = config.lora_mode == "merged"
        if num_pages < MIN_KV_BLOCKS:
            raise ConfigError(
                f"the cache pool ({config.cache_bytes()} bytes) holds {num_pages} pages of "
                f"{page_bytes} bytes; at least {MIN_KV_BLOCKS} are needed"
            )
        limits = [spec.max_position_embeddings, num_pages * config.block_size]
        if config.max_model_len:
            limits.append(config.max_model_len)
        if spec.sliding_window:
            limits.append(spec.sliding_window)
        self.max_model_len = min(limits)
        self.pool = CachePool(
            spec, num_pages, config.block_size, config.torch_dtype, config.torch_device
        )
        self.kv_cache = self.pool.kv
        self.blocks = BlockManager(
            num_pages, config.block_size, config.enable_prefix_caching, self._may_reuse
        )
        self.adapters = ResidencyManager(
            None if merged else self.pool,
            self.blocks,
            HostCache(config.max_cpu_loras),
            AdapterLoader(spec, config.max_lora_rank),
            AdapterRegistry(),
            max_loras=config.max_loras,
            quantum_s=config.residency_quantum_ms / 1000,
            events=self.hooks,
            merge=self._merge if merged else None,
        )
        if adapter_dir is not None:
            self.adapters.registry.add_dir(Path(adapter_dir).expanduser())
        for adapter_id, path in (adapters or {}).items():
            self.adapters.register(adapter_id, Path(path).expanduser())
        if config.static_adapter is not None:
            self._merge_static(config.static_adapter)
        self.scheduler = Scheduler(
            self.blocks, self.adapters, self.bind_cache, config.max_batch_tokens,
            config.max_num_seqs, self.hooks, reject_when_busy=config.reject_when_busy,
            page_bytes=page_bytes,
        )  # fmt: skip
        self.runner = ModelRunner(self.model, self.kv_cache, config.block_size, config.lora_compute)
        self.requests: dict[str, Sequence] = {}
        self.stats = EngineStats()

    def _merge(self, adapter: LoRAAdapter | None) -> None:
        if adapter is None:
            self.model.unmerge_lora()
        else:
            reversible = self.config.static_adapter is None
            self.model.merge_lora(adapter.weights, reversible=reversible)

    def _merge_static(self, adapter_id: str) -> None:
        """The static baseline: one adapter merged for good before serving starts."""
        entry = self.adapters.registry.get(adapter_id)
        if entry is None:
            raise ConfigError(f"static adapter {adapter_id!r} is not among the adapters")
        adapter = read_adapter(adapter_id, entry.path, self.model.spec, self.config.max_lora_rank)
        self.adapters.host.put(adapter)
        binding = self.adapters.acquire_merged(adapter_id)
        assert binding is not None
        self.adapters.release_merged()

    def bind_cache(self, seq: Sequence, content_hash: str | None) -> None:
        """Set ``seq``'s prefix-cache scope (the weights its KV is computed under) and namespace
        (the key its blocks are shared by: the scope, unless a plugin says otherwise)."""
        scope = ("base", self.model_id, "adapter", seq.adapter_id, "weights", content_hash)
        namespace = None
        if self.hooks.has("lora_guard_cache_namespace"):
            namespace = self.hooks.cache_namespace(
                request=seq.view(), base_model_id=self.model_id, adapter_hash=content_hash
            )
        seq.cache_scope = scope
        seq.cache_namespace = scope if namespace is None else namespace

    def _may_reuse(self, block: Block, seq: Sequence) -> bool:
        return self.hooks.cache_reuse(
            request=seq.view(), block_scope=block.scope, request_scope=seq.cache_scope
        )

    # requests
    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        adapter_id: str | None = None,
        tenant_id: str = "default",
        cache_salt: str | None = None,
    ) -> Sequence:
        params = params or SamplingParams()
        if request_id in self.requests:
            raise RequestError(f"request id {request_id!r} is already in use")
        if adapter_id is not None and not self.adapters.knows(adapter_id):
            raise UnknownAdapterError(f"adapter {adapter_id!r} is not known")
        static = self.config.static_adapter
        if static is not None and adapter_id != static:
            raise RequestError(
                f"this engine serves only adapter {static!r}, merged into the base weights "
                "(policy static)"
            )
        token_ids = self.encode(prompt)
        if not token_ids:
            raise RequestError("the prompt is empty")
        if any(not 0 <= t < self.model.spec.vocab_size for t in token_ids):
            raise RequestError("the prompt holds token ids outside the vocabulary")
        total = len(token_ids) + params.max_new_tokens
        if total > self.max_model_len:
            raise RequestError(
                f"`inputs` tokens + `max_new_tokens` must be <= {self.max_model_len}. "
                f"Given: {len(token_ids)} `inputs` tokens and {params.max_new_tokens} "
                "`max_new_tokens`"
            )
        seq = Sequence(
            request_id, token_ids, params, adapter_id, tenant_id,
            arrival_time=time.monotonic(), cache_salt=cache_salt,
        )  # fmt: skip
        if params.seed is not None:
            seq.generator = torch.Generator(device=self.config.torch_device)
            seq.generator.manual_seed(params.seed)
        self.requests[request_id] = seq
        self.scheduler.add(seq)
        return seq

    def encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return encode_text(self.tokenizer, prompt)
        return [int(t) for t in prompt]

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request now and free its blocks and slot; returns its last state."""
        seq = self.requests.pop(request_id, None)
        if seq is None:
            return None
        self.scheduler.finish(seq)
        seq.finish_reason = FinishReason.ABORT
        self._finished(seq)
        self._step_finished(0, 0.0)  # observers see the freed blocks even if no step follows
        return self._output(seq)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # the step
    def step(self) -> list[RequestOutput]:
        try:
            return self._step()
        finally:
            self.adapters.end_step()

    def _step(self) -> list[RequestOutput]:
        started = time.perf_counter()
        plan = self.scheduler.schedule()
        outputs = []
        for failure in plan.failed:
            outputs.append(self._fail(failure.seq, failure.reason, failure.retry_after))
        self.stats.preemptions += len(plan.preempted)
        if not plan.scheduled:
            if plan.failed:
                self._step_finished(0, time.perf_counter() - started)
            return outputs
        for src, dst in self.blocks.pending_copies:
            self.kv_cache.copy_block(src, dst, self.config.block_size)
        self.blocks.pending_copies.clear()
        try:
            result = self.runner.run(plan.scheduled)
            tokens, logprobs = sample(
                result.logits,
                [SamplerInput(s.params, s.generator, s.token_ids) for s in result.sampled],
            )
        except Exception as exc:
            # A failed forward or sampler fails the requests in its step, never the engine.
            log.exception("step failed; failing its %d requests", len(plan.scheduled))
            for item in plan.scheduled:
                outputs.append(self._fail(item.seq, f"generation failed: {exc}"))
            self._step_finished(0, time.perf_counter() - started)  # observers see blocks freed
            return outputs
        for item in plan.scheduled:
            item.seq.num_computed_tokens += item.num_new_tokens
            self.blocks.commit(item.seq)
        now = time.monotonic()
        for seq, token, logprob in zip(result.sampled, tokens, logprobs, strict=True):
            if seq.first_token_time is None:
                seq.first_token_time = now
            seq.token_ids.append(token)
            seq.logprobs.append(logprob)
            self.stats.generated_tokens += 1
            outputs.append(self._after_token(seq, token))
        self.stats.steps += 1
        self.stats.prompt_tokens += plan.num_tokens - len(result.sampled)
        duration = time.perf_counter() - started
        self.stats.step_times.append(duration)
        self._step_finished(plan.num_tokens, duration)
        return outputs

    def _step_finished(self, num_tokens: int, duration: float) -> None:
        if not self.hooks.has("lora_guard_step_finished"):
            return  # no observer: do not build the state view on the step loop
        self.hooks.notify(
            "lora_guard_step_finished",
            state=self.scheduler.state(fresh=True), num_tokens=num_tokens, duration_s=duration,
            kv_conflicts=self.blocks.stats.conflicts, cached_tokens=self.blocks.stats.hit_tokens,
        )  # fmt: skip

    def _after_token(self, seq: Sequence, token: int) -> RequestOutput:
        params = seq.params
        text = self._decode(seq)
        stop_sequence = None
        if token in self.eos_token_ids and not params.ignore_eos:
            seq.finish_reason = FinishReason.EOS
        for stop in params.stop:
            index = text.find(stop)
            if index != -1:
                seq.finish_reason, stop_sequence, text = FinishReason.STOP, stop, text[:index]
                break
        if seq.finish_reason is None and (
            len(seq.output_token_ids) >= params.max_new_tokens
            or len(seq.token_ids) >= self.max_model_len
        ):
            seq.finish_reason = FinishReason.LENGTH
        if seq.finish_reason is not None:
            self.scheduler.finish(seq)
            self.requests.pop(seq.request_id, None)
            self._finished(seq)
        return self._output(seq, text, stop_sequence)

    def _fail(self, seq: Sequence, reason: str, retry_after: float | None = None) -> RequestOutput:
        self.scheduler.finish(seq)
        self.requests.pop(seq.request_id, None)
        seq.finish_reason, seq.error, seq.retry_after = FinishReason.ERROR, reason, retry_after
        self._finished(seq)
        return self._output(seq)

    def _finished(self, seq: Sequence) -> None:
        assert seq.finish_reason is not None
        self.hooks.notify(
            "lora_guard_request_finished",
            request=seq.view(), finish_reason=seq.finish_reason.value, error=seq.error,
            retry_after=seq.retry_after, num_cached_tokens=seq.num_cached_tokens,
        )  # fmt: skip

    def _decode(self, seq: Sequence) -> str:
        return str(self.tokenizer.decode(seq.output_token_ids, skip_special_tokens=True))

    def _output(
        self, seq: Sequence, text: str | None = None, stop_sequence: str | None = None
    ) -> RequestOutput:
        return RequestOutput(
            request_id=seq.request_id,
            prompt_token_ids=seq.prompt_token_ids,
            token_ids=seq.output_token_ids,
            text=self._decode(seq) if text is None else text,
            logprobs=list(seq.logprobs),
            finished=seq.finish_reason is not None,
            finish_reason=seq.finish_reason.value if seq.finish_reason else None,
            num_cached_tokens=seq.num_cached_tokens,
            error=seq.error,
            stop_sequence=stop_sequence,
            retry_after=seq.retry_after,
        )

    # inspection
    def check_no_leaks(self) -> None:
        """Raise AssertionError unless the engine is idle and holds no block and no slot."""
        assert not self.requests, f"{len(self.requests)} requests are still in the engine"
        assert self.blocks.num_used_blocks == 0, f"{self.blocks.num_used_blocks} KV blocks leaked"
        held = self.adapters.merged_refs + sum(e.in_step for e in self.adapters.residents())
        assert held == 0, f"{held} adapter references leaked"
        pages = sum(e.num_pages for e in self.adapters.residents())
        assert pages == self.adapters.top == len(self.blocks.reserved), (
            f"adapter pages leaked: {pages} in residents, top {self.adapters.top}, "
            f"{len(self.blocks.reserved)} reserved"
        )
        assert not self.scheduler.has_work(), "scheduler still holds sequences"

    def shutdown(self) -> None:
        self.adapters.loader.shutdown()


def model_name(model_dir: Path, hf_config: Any) -> str:
    """The base model's name for ``/info``, ``/v1/models`` and responses, never a path: the name
    its manifest or config records (``SmolLM2-135M-Instruct`` of ``HuggingFaceTB/...``), else
    the checkpoint folder's name."""
    from lora_guard.manifest import read_manifest

    manifest = read_manifest(model_dir) or {}
    recorded = manifest.get("info", {}).get("model_id") or getattr(hf_config, "name_or_path", "")
    recorded = str(recorded or "")
    if recorded and not Path(recorded).expanduser().exists() and not recorded.startswith("/"):
        return recorded.rstrip("/").rsplit("/", 1)[-1]
    return model_dir.resolve().name


def encode_text(tokenizer: Any, prompt: str) -> list[int]:
    """Token ids of a text prompt as the engine reads it: a chat-templated prompt already starts
    with the BOS text, so no second one is added."""
    bos = tokenizer.bos_token
    templated = bool(bos) and prompt.startswith(bos)
    return list(tokenizer.encode(prompt, add_special_tokens=not templated))


def _eos_ids(config: object, tokenizer: object) -> set[int]:
    ids: set[int] = set()
    for source in (getattr(config, "eos_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        if isinstance(source, int):
            ids.add(source)
        elif isinstance(source, list | tuple):
            ids.update(int(x) for x in source)
    return ids
