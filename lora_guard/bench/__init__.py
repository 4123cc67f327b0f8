"""Benchmarks: ``lora-guard bench`` (a multi-adapter workload replayed against each serving
scheme, :mod:`lora_guard.bench.run`) and ``python -m lora_guard.bench.engine`` (engine speed
against transformers + PEFT)."""
