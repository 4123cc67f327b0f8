"""The peer a team would reach for first: transformers + PEFT, every adapter loaded, and the
requests that have arrived run as one mixed-adapter ``generate`` call (``adapter_names``); the next
batch starts when that call returns. Replayed in real time like the engine schemes."""

from __future__ import annotations

import time
from typing import Any

import torch

from lora_guard.bench.load import RequestRecord
from lora_guard.bench.replay import Bind, EngineOptions, SchemeRun, peak_rss_now
from lora_guard.clock import monotonic
from lora_guard.demo.greedy import greedy, left_pad
from lora_guard.engine.tokens import encode_text
from lora_guard.workload.trace import TraceRequest

MAX_BATCH = 32
_BASE = "__base__"  # PEFT's name for "no adapter" in adapter_names


class _FirstToken:
    """A ``generate`` streamer that notes when the first new tokens come out."""

    def __init__(self) -> None:
        self.calls = 0
        self.first: float | None = None

    def put(self, value: torch.Tensor) -> None:
        self.calls += 1
        if self.calls == 2:  # the first call carries the prompt
            self.first = monotonic()

    def end(self) -> None:
        pass


def _load(
    options: EngineOptions, adapters: list[str], dtype: torch.dtype, device: torch.device
) -> tuple[Any, Any, int, int]:
    """The base model with every adapter of the trace loaded into it (PEFT's multi-adapter
    model), the base model's config, the base weights' bytes and the adapters'."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(options.model, dtype=dtype).to(device)
    base_bytes = sum(p.numel() * p.element_size() for p in base.parameters())
    model: Any = base
    for i, name in enumerate(adapters):
        path = f"{options.adapter_dir}/{name}"
        if i == 0:
            model = PeftModel.from_pretrained(base, path, adapter_name=name)
        else:
            model.load_adapter(path, adapter_name=name)
    model.eval()
    lora_bytes = sum(p.numel() * p.element_size() for p in model.parameters()) - base_bytes
    return model, base.config, base_bytes, lora_bytes


def _kv_elements_per_token(config: Any) -> int:
    """KV elements a token takes over every layer (keys and values)."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return int(2 * config.num_hidden_layers * config.num_key_value_heads * head_dim)


def replay_peft(trace: list[TraceRequest], options: EngineOptions) -> SchemeRun:
    from transformers import AutoTokenizer

    dtype = getattr(torch, options.dtype)
    device = torch.device(options.device)
    tokenizer = AutoTokenizer.from_pretrained(options.model)
    adapters = sorted({r.adapter_id for r in trace if r.adapter_id is not None})
    model, config, base_bytes, lora_bytes = _load(options, adapters, dtype, device)
    kv_per_token = _kv_elements_per_token(config) * torch.tensor([], dtype=dtype).element_size()
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0

    loaded = set(model.peft_config) if adapters else set()
    records = {r.id: RequestRecord(r.id, r.adapter_id, r.time) for r in trace}
    binds: list[Bind] = []
    queue = list(trace)
    peak_kv = 0
    start = monotonic()
    while queue:
        now = monotonic() - start
        if queue[0].time > now:
            time.sleep(min(queue[0].time - now, 0.05))
            continue
        batch = [r for r in queue if r.time <= now][:MAX_BATCH]
        queue = [r for r in queue if r not in batch]
        # Every adapter was loaded before the replay; a request finds its own or fails to run.
        binds += [
            Bind(now, r.adapter_id, r.adapter_id in loaded, 0.0)
            for r in batch
            if r.adapter_id is not None
        ]
        prompts = [encode_text(tokenizer, r.prompt) for r in batch]
        ids, mask = left_pad(prompts, pad, device)
        width = ids.shape[1]
        new = max(r.max_new_tokens for r in batch)
        peak_kv = max(peak_kv, len(batch) * (width + new) * kv_per_token)
        clock = _FirstToken()
        names = [r.adapter_id or _BASE for r in batch]
        out = greedy(
            model,
            ids,
            mask,
            new,
            pad,
            min_new_tokens=new,
            eos_token_id=None,
            streamer=clock,
            adapter_names=names,
        )
        done = monotonic() - start
        first = (clock.first - start) if clock.first is not None else done
        for i, request in enumerate(batch):
            record = records[request.id]
            record.tokens = out[i, width : width + request.max_new_tokens].tolist()
            record.first_token, record.finish = first, done
    duration = monotonic() - start
    return SchemeRun(
        scheme="peft",
        records=list(records.values()),
        swap_ms=[],
        lookups=[(b.time, b.hit) for b in binds],
        slots=len(adapters),
        kv_conflicts=0,
        cold_loads={"loaded": len(adapters), "rejected": 0, "failed": 0},
        memory={
            "weights": base_bytes,
            "adapter_slots": lora_bytes,
            "kv_pool": peak_kv,
            "merge_copies": 0,
            "merge_transient": 0,
            "total": base_bytes + lora_bytes + peak_kv,
        },
        peak_rss=peak_rss_now(),
        duration_s=duration,
        served=[r.adapter_id for r in trace],
        binds=binds,
        start_resident=tuple(sorted(loaded)),
    )
