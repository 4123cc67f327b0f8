"""What lora-guard adds to vLLM's ``/metrics``: its own ``lora_guard_*`` families and vLLM's
residency families that vLLM does not serve yet, rendered by the scheduler's process for the
door to forward."""

from __future__ import annotations

from lora_guard.metrics import MetricsPlugin

METRIC_PREFIX = b"lora_guard_"
#: vLLM's residency families (its open pull requests): served by lora-guard until vLLM serves them
RESIDENCY_FAMILIES = (
    b"vllm:lora_adapter_loaded",
    b"vllm:num_gpu_loaded_lora_adapters",
    b"vllm:num_cpu_loaded_lora_adapters",
    b"vllm:max_gpu_lora_adapters",
    b"vllm:lora_adapter_load_seconds",
)


def own_metrics(metrics: MetricsPlugin) -> bytes:
    """The ``lora_guard_*`` families of the exposition and vLLM's residency families (vLLM serves
    its other ``vllm:*``; the door drops a family vLLM serves itself)."""
    kept, keep = [], False
    forwarded = (METRIC_PREFIX, *RESIDENCY_FAMILIES)
    for line in metrics.render().splitlines(keepends=True):
        if line.startswith((b"# HELP ", b"# TYPE ")):
            keep = line.split(b" ", 3)[2].startswith(forwarded)
        elif not line.startswith(b"#"):
            keep = line.startswith(forwarded)
        if keep:
            kept.append(line)
    return b"".join(kept)
