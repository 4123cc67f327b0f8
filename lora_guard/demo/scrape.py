"""A server's ``/metrics`` read as a scraper reads it: every sample, one metric's sum, and the
tier llm-d's LoRA scorer would give an adapter."""

from __future__ import annotations


def metric_samples(
    url: str, headers: dict[str, str] | None = None
) -> dict[str, list[tuple[dict[str, str], float]]]:
    """``GET /metrics`` as ``{family name: [(labels, value), ...]}`` (``headers``: an admin key,
    where the server has a key file)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    reply = httpx.get(url + "/metrics", headers=headers, timeout=10)
    reply.raise_for_status()
    found: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(reply.text):
        for sample in family.samples:
            found.setdefault(sample.name, []).append((sample.labels, sample.value))
    return found


#: llm-d's ``lora-load-state-scorer`` tiers, its defaults
GPU, CPU, FREE_SLOT, EVICTABLE, SATURATED = 1.0, 0.7, 0.6, 0.3, 0.0


def scorer_tier(url: str, adapter: str) -> float:
    """The tier llm-d's ``lora-load-state-scorer`` gives ``adapter`` on the server at ``url``,
    read from its ``/metrics`` alone as the scorer's ``classify`` reads it."""
    samples = metric_samples(url)
    loaded = {
        labels["adapter_name"]: labels
        for labels, value in samples.get("vllm:lora_adapter_loaded", [])
        if value > 0
    }
    gpu_loaded = samples["vllm:num_gpu_loaded_lora_adapters"][0][1]
    max_active = samples["vllm:max_gpu_lora_adapters"][0][1]
    info = samples.get("vllm:lora_requests_info", [({}, 0.0)])[0][0]
    active = {a for a in info.get("running_lora_adapters", "").split(",") if a}
    state = loaded.get(adapter)
    if state is not None:
        return GPU if state["level"] == "gpu" else CPU
    if gpu_loaded < max_active:
        return FREE_SLOT
    idle = [
        name
        for name, labels in loaded.items()
        if labels["level"] == "gpu" and labels["pinned"] == "false" and name not in active
    ]
    return EVICTABLE if idle else SATURATED


def metric(url: str, name: str, headers: dict[str, str] | None = None, **labels: str) -> float:
    """The sum of the samples of ``name`` (a sample name, ``_total`` included) with ``labels``."""
    rows = metric_samples(url, headers).get(name, [])
    return sum(v for found, v in rows if all(found.get(k) == w for k, w in labels.items()))
