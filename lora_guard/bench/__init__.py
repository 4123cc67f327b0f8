"""Benchmarks: ``python -m lora_guard.bench.engine`` (engine speed against transformers + PEFT)."""
