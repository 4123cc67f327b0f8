"""The engine's step records (``stats.recent_steps``, ``--step-log FILE``) and the step cost the
simulator fits to them."""

from __future__ import annotations

import json
import logging
from dataclasses import asdict
from pathlib import Path

import pytest

from lora_guard.demo.testing import AdapterFactory
from lora_guard.engine import LLM, SamplingParams
from lora_guard.engine.outputs import STEP_LOG_CHECK_EVERY, JsonLog, StepRecord
from lora_guard.engine.values import ConfigError
from lora_guard.simulate_costs import MIB, Costs, fit_steps, read_step_log, with_step_fit


def test_each_step_is_logged_with_what_it_computed(
    tiny_model: Path, tiny_adapters: AdapterFactory, tmp_path: Path
) -> None:
    adapters = tiny_adapters(3, "log", ranks=(4, 8, 8))
    log = tmp_path / "steps.jsonl"
    llm = LLM(
        tiny_model,
        adapters=adapters,
        max_loras=2,
        enable_prefix_caching=False,
        max_batch_tokens=16,
        block_size=4,
        step_log=str(log),
        policies="lru",
    )
    prompts = ["one two three four five six seven eight nine ten eleven", "a b c", "x y z w"]
    ids = [*adapters, None]
    outs = llm.generate(prompts, SamplingParams(max_new_tokens=5, ignore_eos=True), ids[:3])
    engine = llm.engine
    steps = read_step_log(log)
    engine.shutdown()
    assert steps == list(engine.stats.recent_steps) and len(steps) == engine.stats.steps
    assert [s.step for s in steps] == list(range(1, len(steps) + 1))
    # Every prompt token prefilled once (long prompts in chunks of the 16-token budget), every
    # other row a decode; each load counted in the step that wrote it.
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outs)
    assert sum(s.prefill_tokens for s in steps) == prompt_tokens
    assert max(s.prefill_tokens for s in steps) <= 16
    assert sum(s.seqs for s in steps) >= sum(len(o.token_ids) for o in outs)
    assert sum(s.loads for s in steps) == engine.adapters.stats.loads == 3
    assert all(s.adapter_bytes > 0 and 1 <= s.adapters <= 2 for s in steps)  # 2 seats
    assert max(s.adapter_bytes for s in steps) < 2 * MIB and all(s.seconds > 0 for s in steps)


def test_an_unwritable_step_log_is_refused_at_start(tiny_model: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="step_log: cannot write"):
        LLM(tiny_model, step_log=str(tmp_path / "no-such-folder" / "steps.jsonl"))


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full (a full disk)")
def test_a_step_log_that_cannot_be_written_stops_and_the_engine_goes_on(
    tiny_model: Path, caplog: pytest.LogCaptureFixture
) -> None:
    llm = LLM(tiny_model, step_log="/dev/full")
    outs = llm.generate(["a full disk"], SamplingParams(max_new_tokens=3, ignore_eos=True))
    assert len(outs[0].token_ids) == 3 and outs[0].error is None
    assert not llm.engine.step_log.writing and "step log /dev/full stopped" in caplog.text
    assert len(llm.engine.stats.recent_steps) == llm.engine.stats.steps
    llm.engine.shutdown()


def test_the_step_cost_fitted_to_steps_is_their_line() -> None:
    def ms(seqs: int, mib: float, prefill: int, loads: int) -> float:
        return 5.0 + 0.5 * seqs + 2.0 * mib + 0.25 * prefill + 9.0 * loads

    grid = [
        (seqs, mib, prefill, loads)
        for seqs in (1, 2, 4)
        for mib in (0.0, 1.0, 3.0)
        for prefill in (0, 32)
        for loads in (0, 1)
    ]
    steps = [
        StepRecord(i, 0.0, ms(*g) / 1000, g[0], 1, int(g[1] * MIB), g[2], g[3])
        for i, g in enumerate(grid)
    ]
    without = fit_steps(steps)  # load steps left out
    assert without.samples == len(grid) // 2
    assert without.coefficients == pytest.approx((5.0, 0.5, 2.0, 0.25), abs=1e-6)
    costs = with_step_fit(Costs(adapter_mib=1.0), fit_steps(steps, loads=True), "test")
    assert costs.step(2, 1, 32) == pytest.approx(ms(2, 1.0, 32, 0))
    assert costs.write() == pytest.approx(9.0) and costs.source == "test"
    with pytest.raises(ValueError, match="at least 4"):
        fit_steps(steps[:3])


def test_a_full_step_log_is_kept_as_one_older_file_and_a_new_one_begins(tmp_path: Path) -> None:
    path = tmp_path / "steps.jsonl"
    record = StepRecord(1, 0.0, 0.03, 2, 1, MIB, 16, 0)
    line = len(json.dumps(asdict(record))) + 1
    other = JsonLog.open(str(path), max_bytes=10 * line)  # another replica on the same file
    log = JsonLog.open(str(path), max_bytes=10 * line)
    for _ in range(STEP_LOG_CHECK_EVERY * 3):
        log.write(record)
    other.write(record)  # still writes where it opened: the renamed file, until it looks
    older = path.with_name(path.name + ".1")
    assert older.exists() and path.stat().st_size < path.with_name(path.name + ".1").stat().st_size
    assert path.stat().st_size <= STEP_LOG_CHECK_EVERY * line  # rotated, not grown without bound
    for _ in range(STEP_LOG_CHECK_EVERY - 1):
        other.write(record)  # its look finds the file renamed: it follows to the new one
    other.write(record)
    log.close()
    other.close()
    assert read_step_log(path)[-1] == record and read_step_log(older)
    assert not path.with_name(path.name + ".2").exists()


def test_float16_on_a_cpu_is_warned_of(tiny_model: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="lora_guard.engine.builder"):
        llm = LLM(tiny_model, dtype="float16", kv_cache_memory="4MiB", policies="lru")
        llm.engine.shutdown()
        LLM(tiny_model, dtype="bfloat16", kv_cache_memory="4MiB", policies="lru").engine.shutdown()
    warned = [r.getMessage() for r in caplog.records if "float16 on a CPU" in r.getMessage()]
    assert len(warned) == 1 and "--dtype bfloat16" in warned[0]
