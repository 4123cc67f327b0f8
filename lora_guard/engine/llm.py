"""``lora_guard.LLM``: offline batches on the engine."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from collections.abc import Sequence as SequenceOf
from pathlib import Path
from typing import Any

import torch

from lora_guard.clock import monotonic
from lora_guard.engine.builder import build_engine as build_engine  # its former home
from lora_guard.engine.config import describe, user_fields
from lora_guard.engine.outputs import RequestOutput
from lora_guard.engine.sampling import SamplingParams
from lora_guard.plugins.manager import Hooks, make_plugin_manager, parse_policies

_IDLE_WAIT_S = 0.001


class LLM:
    """A base model with LoRA adapters, for batches of prompts.

    ``model`` and the keywords ``model_id`` to ``max_model_len`` are the fields of
    ``EngineConfig``, with its defaults; their help is at the end here and in docs/engine.md.

    :param adapter_dir: folder whose subfolders are PEFT adapters; the id is the folder name.
    :param adapters: more adapters, ``{id: folder}``.
    :param policies: ``"hot-set,cold-budget,kv-namespace"`` (the default), any subset of them, or
        one baseline: ``"lru"``, ``"on-demand"`` (one adapter at a time, merged into the base
        weights) or ``"static"`` (``settings["static_adapter"]`` merged for good; requests for
        anything else are refused).
    :param plugins: more plugins, ``"module[:object]"``.
    :param disabled_plugins: plugin names not to load (built-ins and entry points alike).
    :param settings: plugin settings by name (``{"cold_loads_per_minute": 6}``); see
        ``docs/policies.md``.
    :param clock: the engine's time in seconds (``monotonic``): arrivals, the heat window,
        the residency quantum and the policies' ``state.now`` read it; a simulation passes its own.
    """

    def __init__(
        self,
        model: str | Path,
        adapter_dir: str | Path | None = None,
        adapters: dict[str, str | Path] | None = None,
        *,
        model_id: str | None = None,
        device: str | torch.device = "auto",
        dtype: str | torch.dtype = "auto",
        lora_dtype: str | torch.dtype = "auto",
        max_loras: int = 0,
        max_cpu_loras: int = 32,
        max_lora_rank: int = 64,
        cache_memory: int | str | None = None,
        kv_cache_memory: int | str | None = None,
        adapter_memory: int | str | None = None,
        residency_quantum_ms: int = 1000,
        lora_compute: str = "auto",
        weight_layout: str = "auto",
        block_size: int = 16,
        enable_prefix_caching: bool = True,
        max_batch_tokens: int = 2048,
        max_num_seqs: int = 64,
        max_model_len: int | None = None,
        step_log: str | None = None,
        policies: str | SequenceOf[str] | None = None,
        plugins: SequenceOf[str] = (),
        disabled_plugins: SequenceOf[str] = (),
        settings: dict[str, Any] | None = None,
        clock: Callable[[], float] = monotonic,
    ) -> None:
        given = locals()
        config = {f.name: given[f.name] for f in user_fields()}  # the engine's fields, once
        chosen = parse_policies(policies)
        hooks = Hooks(make_plugin_manager(chosen, plugins, disabled_plugins))
        self.engine = build_engine(
            hooks,
            chosen,
            settings or {},
            adapters=adapters,
            adapter_dir=adapter_dir,
            reject_when_busy=False,
            clock=clock,
            **config,
        )
        self._ids = itertools.count()

    @property
    def tokenizer(self):  # type: ignore[no-untyped-def]
        return self.engine.tokenizer

    def add_adapter(self, adapter_id: str, path: str | Path) -> None:
        """Add an adapter, or replace one; replaced weights are read again on next use."""
        self.engine.register_adapter(adapter_id, Path(path))

    def generate(
        self,
        prompts: str | list[int] | SequenceOf[str | list[int]],
        sampling_params: SamplingParams | SequenceOf[SamplingParams] | None = None,
        adapter_ids: SequenceOf[str | None] | str | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in the order of ``prompts``.

        A prompt is a string or a list of token ids. ``adapter_ids[i]`` names the adapter of
        prompt ``i`` (None: the base model); one string applies to every prompt. No prompt is
        dropped for a policy: where a server would answer "busy, retry later", a batch waits.
        """
        batch: list[str | list[int]]
        if isinstance(prompts, str) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            batch = [prompts]
        else:
            batch = list(prompts)  # type: ignore[arg-type]
        params: list[SamplingParams] = _per_prompt(sampling_params, len(batch), SamplingParams())
        adapters: list[str | None] = _per_prompt(adapter_ids, len(batch), None)
        ids = [f"offline-{next(self._ids)}" for _ in batch]
        try:
            for request_id, prompt, p, adapter in zip(ids, batch, params, adapters, strict=True):
                self.engine.add_request(request_id, prompt, p, adapter)
        except Exception:
            for request_id in ids:
                self.engine.abort(request_id)
            raise
        finished: dict[str, RequestOutput] = {}
        while len(finished) < len(ids):
            outputs = self.engine.step()
            for out in outputs:
                if out.finished:
                    finished[out.request_id] = out
            if not outputs:
                time.sleep(_IDLE_WAIT_S)  # waiting for an adapter load
        return [finished[i] for i in ids]


LLM.__doc__ = (LLM.__doc__ or "").rstrip() + "".join(
    f"\n    :param {f.name}: {describe(f.metadata['help'], lambda n: f'``{n}``')}"
    for f in user_fields()
)


def _per_prompt(value: Any, n: int, default: Any) -> list[Any]:
    if value is None:
        return [default] * n
    if isinstance(value, str | SamplingParams):
        return [value] * n
    values = list(value)
    if len(values) != n:
        raise ValueError(f"expected {n} values, one per prompt, got {len(values)}")
    return values
