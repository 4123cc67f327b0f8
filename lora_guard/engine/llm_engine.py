"""The engine loop: requests in, one step at a time (schedule, run, postprocess), outputs out.

The parts are made and wired by :func:`lora_guard.engine.builder.build_engine`: the scheduler owns
the block manager and the adapters' residency, the runner owns the model and the KV tensors. Not
thread-safe: one thread drives it (``LLM`` directly, ``AsyncEngine`` from its loop)."""

from __future__ import annotations

import logging
from typing import Any

import torch

from lora_guard.clock import timer, wall
from lora_guard.engine.config import EngineConfig
from lora_guard.engine.errors import RequestError as RequestError  # re-exported
from lora_guard.engine.outputs import EngineStats, JsonLog, RequestOutput, StepRecord
from lora_guard.engine.queries import EngineQueries
from lora_guard.engine.request_check import RequestCheck
from lora_guard.engine.runner import ModelRunner, StepResult
from lora_guard.engine.sampling import SamplingParams
from lora_guard.engine.scheduler import Scheduler
from lora_guard.engine.sequence import FinishReason, Sequence
from lora_guard.engine.step_plan import SchedulerOutput
from lora_guard.engine.tokens import encode_text, eos_token_ids
from lora_guard.plugins.manager import Hooks

log = logging.getLogger(__name__)


class LLMEngine(EngineQueries):
    """One base model, its adapters and the step loop; what callers outside the engine ask of
    it is in :class:`EngineQueries`."""

    def __init__(
        self,
        config: EngineConfig,
        hooks: Hooks,
        tokenizer: Any,
        model_id: str,
        scheduler: Scheduler,
        runner: ModelRunner,
        check: RequestCheck,
    ) -> None:
        self.config, self.hooks, self.tokenizer, self.model_id = config, hooks, tokenizer, model_id
        self.scheduler, self.runner, self.check = scheduler, runner, check
        self.clock = config.clock
        self.max_model_len = check.max_model_len
        self.eos_token_ids = eos_token_ids(runner.model.config, tokenizer)
        runner.eos_token_ids = frozenset(self.eos_token_ids)
        # the parts, for the engine's own modules and white-box tests (callers: EngineQueries)
        self.adapters, self.blocks = scheduler.adapters, scheduler.blocks
        self.model, self.pool = runner.model, runner.pool
        self.requests: dict[str, Sequence] = {}
        self.stats = EngineStats()
        self.step_log = JsonLog.open(config.step_log)

    # requests
    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        adapter_id: str | None = None,
        tenant_id: str = "default",
        cache_salt: str | None = None,
        arrival_time: float | None = None,
    ) -> Sequence:
        """Queue a request. Raises :class:`RequestError` before queuing anything, as
        ``UnknownAdapterError`` for an adapter the registry does not hold. ``arrival_time`` (on
        the engine's clock, :attr:`clock`) is when the request reached the engine, if before
        this call."""
        params = params or SamplingParams()
        if request_id in self.requests:
            raise RequestError(f"request id {request_id!r} is already in use")
        self.check.adapter(adapter_id)
        token_ids = self.encode(prompt)
        self.check.prompt(token_ids, params)
        arrival = self.clock() if arrival_time is None else arrival_time
        seq = Sequence(request_id, token_ids, params, adapter_id, tenant_id, arrival, cache_salt)
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
        seq = self.requests.get(request_id)
        if seq is None:
            return None
        self._finish(seq, FinishReason.ABORT)
        self._step_finished(0, 0.0)  # observers see the freed blocks even if no step follows
        return RequestOutput.of(seq, self._decode(seq))

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # the step
    def step(self) -> list[RequestOutput]:
        started, begun, loads = timer(), self.clock(), self.adapters.stats.loads
        try:
            plan = self.scheduler.schedule()
            outputs = [self._fail(f.seq, f.reason, f.retry_after) for f in plan.failed]
            self.stats.preemptions += len(plan.preempted)
            if not plan.scheduled:
                if plan.failed:
                    self._step_finished(0, timer() - started)
                return outputs
            try:
                result = self.runner.run(plan)
            except Exception as exc:
                # A failed forward or sampler fails the requests in its step, never the engine.
                log.exception("step failed; failing its %d requests", len(plan.scheduled))
                outputs += [self._fail(s.seq, f"generation failed: {exc}") for s in plan.scheduled]
                self._step_finished(0, timer() - started)  # observers see blocks freed
                return outputs
            return outputs + self._postprocess(plan, result, (started, begun), loads)
        finally:
            self.scheduler.end_step()

    def _postprocess(
        self, plan: SchedulerOutput, result: StepResult, start: tuple[float, float], loads: int
    ) -> list[RequestOutput]:
        """``start``: when the step began, on the wall timer and on the engine's clock."""
        (started, begun), prefill = start, plan.prefill_tokens()
        self.scheduler.advance(plan)
        seconds = timer() - started
        for scheduled in plan.scheduled:
            seq = scheduled.seq
            seq.step_s += seconds
            if seq.first_step_time is None:
                seq.first_step_time = begun
        now, outputs = self.clock(), []
        for seq, token, logprob in zip(result.sampled, result.tokens, result.logprobs, strict=True):
            if seq.first_token_time is None:
                seq.first_token_time = now
            seq.token_ids.append(token)
            seq.logprobs.append(logprob)
            self.stats.generated_tokens += 1
            outputs.append(self._after_token(seq, token))
        self.stats.steps += 1
        self.stats.prompt_tokens += plan.num_tokens - len(result.sampled)
        self._step_finished(plan.num_tokens, timer() - started)
        seconds, adapters = timer() - started, plan.adapter_bytes()
        if not self.adapters.costs.external:
            self.adapters.costs.step(prefill, seconds * 1000)
        batch = (len(plan.scheduled), len(adapters), sum(adapters), prefill)
        loads = self.adapters.stats.loads - loads
        record = StepRecord(self.stats.steps, wall(), seconds, *batch, loads)
        self.stats.recent_steps.append(record)
        self.step_log.write(record)
        return outputs

    def _after_token(self, seq: Sequence, token: int) -> RequestOutput:
        params, text, stop_sequence = seq.params, self._decode(seq), None
        reason = FinishReason.EOS if token in self.eos_token_ids and not params.ignore_eos else None
        if token in params.stop_token_ids:
            reason = FinishReason.STOP
        for stop in params.stop:
            index = text.find(stop)
            if index != -1:
                reason, stop_sequence, text = FinishReason.STOP, stop, text[:index]
                break
        if reason is None and (
            len(seq.output_token_ids) >= params.max_new_tokens
            or len(seq.token_ids) >= self.max_model_len
        ):
            reason = FinishReason.LENGTH
        if reason is not None:
            self._finish(seq, reason)
        return RequestOutput.of(seq, text, stop_sequence)

    def _fail(self, seq: Sequence, error: str, retry_after: float | None = None) -> RequestOutput:
        seq.error, seq.retry_after = error, retry_after
        self._finish(seq, FinishReason.ERROR)
        return RequestOutput.of(seq, self._decode(seq))

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        self.scheduler.finish(seq)
        self.requests.pop(seq.request_id, None)
        seq.finish_reason, seq.finished_time = reason, self.clock()
        self.hooks.notify(
            "lora_guard_request_finished",
            request=seq.view(),
            finish_reason=reason.value,
            error=seq.error,
            retry_after=seq.retry_after,
            num_cached_tokens=seq.num_cached_tokens,
        )

    def _step_finished(self, num_tokens: int, duration: float) -> None:
        if not self.hooks.has("lora_guard_step_finished"):
            return  # no observer: do not build the state view on the step loop
        self.hooks.notify(
            "lora_guard_step_finished",
            state=self.scheduler.state(fresh=True),
            num_tokens=num_tokens,
            duration_s=duration,
            kv_conflicts=self.blocks.stats.conflicts,
            cached_tokens=self.blocks.stats.hit_tokens,
        )

    def _decode(self, seq: Sequence) -> str:
        skip = seq.params.skip_special_tokens
        return str(self.tokenizer.decode(seq.output_token_ids, skip_special_tokens=skip))

    # inspection
    def check_no_leaks(self) -> None:
        """Raise AssertionError unless the engine is idle and holds no block and no slot."""
        assert not self.requests, f"{len(self.requests)} requests are still in the engine"
        self.scheduler.check_no_leaks()

    def shutdown(self) -> None:
        self.adapters.loader.shutdown()
        self.step_log.close()
