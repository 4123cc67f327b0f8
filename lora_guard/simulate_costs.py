"""The simulator's costs, measured on the engine (``lora-guard simulate --calibrate OUT.json``).

Steps: batches of 1 to 32 sequences over 0 to 8 resident adapters, prompts of two lengths, the
requests of a batch arriving one a step as in serving (each prefill joins the decodes), each
step of ``LLMEngine.step`` timed with what it computed (sequences, the bytes of the distinct
adapters it read, the prompt tokens it prefilled). The step cost is fitted as a line,
``fixed + per sequence + per MiB of adapter bytes + per prefill token``, by least squares; the
fit's error is printed and written beside the costs. Loads: for each adapter, the read of its
folder into host memory (what the loader thread does) and its write into the cache pool over an
evicted one (what a step does), each fitted as ``fixed + per MiB``.

This module imports no torch until it measures: the simulator reads the costs without it.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lora_guard.clock import timer

if TYPE_CHECKING:
    from lora_guard.engine import LLM
    from lora_guard.engine.outputs import StepRecord

MIB = 2**20
BATCHES = (1, 4, 16, 32)
ADAPTERS_PER_BATCH = (0, 1, 4, 8)
PROMPT_TOKENS = (16, 96)
DEFAULT_SOURCE = "the demo model on a quiet 2-core CPU, float32 (docs/simulate-costs.json)"


@dataclass(frozen=True)
class Costs:
    """Engine costs in milliseconds. The defaults are the demo model's (SmolLM2-135M, float32,
    8 adapters of ranks 8 to 32 on every projection) on a quiet 2-core CPU (load average 1.3 to
    1.9, the calibration's own), rounded from the run of ``lora-guard simulate --calibrate
    docs/simulate-costs.json`` (docs/simulate.md) of 2026-12-03."""

    step_ms: float = 33.4
    step_per_seq_ms: float = 2.41
    step_per_adapter_mib_ms: float = 0.0635
    step_lora_ms: float = 0.0  # a step that reads any adapter (kernel launches); the fit's 0
    prefill_per_token_ms: float = 1.59
    read_ms: float = -4.97  # an adapter's folder into host memory, on the loader thread
    read_per_mib_ms: float = 2.73
    write_ms: float = 10.6  # host memory into the cache pool, in the step
    write_per_mib_ms: float = 0.226
    adapter_mib: float = 19.8  # one adapter's weights
    source: str = DEFAULT_SOURCE

    def step(
        self, num_seqs: int, num_adapters: int, prefill_tokens: int, mib: float | None = None
    ) -> float:
        """A step's cost; ``mib``: the adapter weights the batch reads (default: ``num_adapters``
        of ``adapter_mib`` each)."""
        mib = self.adapter_mib * num_adapters if mib is None else mib
        return (
            self.step_ms
            + self.step_lora_ms * (num_adapters > 0)
            + self.step_per_seq_ms * num_seqs
            + self.step_per_adapter_mib_ms * mib
            + self.prefill_per_token_ms * prefill_tokens
        )

    def read(self, mib: float | None = None) -> float:
        return self.read_ms + self.read_per_mib_ms * (self.adapter_mib if mib is None else mib)

    def write(self, mib: float | None = None) -> float:
        return self.write_ms + self.write_per_mib_ms * (self.adapter_mib if mib is None else mib)

    def load(self) -> float:
        """A cold load: read from disk, then written into the pool."""
        return self.read() + self.write()


@dataclass(frozen=True)
class LoadSample:
    adapter_mib: float
    read_ms: float
    write_ms: float


@dataclass(frozen=True)
class Fit:
    """A least-squares line and how far the samples are from it."""

    coefficients: tuple[float, ...]
    rms_ms: float
    rms_relative: float  # RMS of (fitted - measured) / measured
    worst_relative: float
    samples: int


def fit_line(rows: Sequence[Sequence[float]], measured: Sequence[float]) -> Fit:
    """Least squares of ``measured`` on ``rows`` (each row its features, a 1 first)."""
    import numpy as np

    x, y = np.asarray(rows, dtype=float), np.asarray(measured, dtype=float)
    coefficients, *_ = np.linalg.lstsq(x, y, rcond=None)
    error = x @ coefficients - y
    relative = error / y
    return Fit(
        tuple(float(c) for c in coefficients),
        float(np.sqrt(np.mean(error**2))),
        float(np.sqrt(np.mean(relative**2))),
        float(np.max(np.abs(relative))),
        len(y),
    )


def fit_steps(steps: Sequence[StepRecord], loads: bool = False) -> Fit:
    """The step cost's line, ``fixed + per sequence + per MiB of adapter weights read + per
    prefill token`` in milliseconds, fitted to engine steps (``LLMEngine.stats.recent_steps``: a
    calibration's, or a fleet's step log). Steps that wrote an adapter into the pool are left
    out, or with ``loads`` fitted with a fifth term, per adapter written (the write as the
    fleet's steps make it)."""
    used = [s for s in steps if s.seqs and (loads or not s.loads)]
    terms = 5 if loads else 4
    if len(used) < terms:
        raise ValueError(f"{len(used)} steps to fit; the step cost needs at least {terms}")
    rows = [(1, s.seqs, s.adapter_bytes / MIB, s.prefill_tokens, s.loads)[:terms] for s in used]
    return fit_line(rows, [s.seconds * 1000 for s in used])


def read_step_log(path: Path) -> list[StepRecord]:
    """The steps of a step log (``lora-guard serve --step-log FILE``: a line a step, of one or
    many replicas)."""
    from lora_guard.engine.outputs import StepRecord

    with path.open() as lines:
        return [StepRecord(**json.loads(line)) for line in lines if line.strip()]


def with_step_fit(costs: Costs, fit: Fit, source: str) -> Costs:
    """``costs`` with the step cost of ``fit`` (:func:`fit_steps`), and the write's when the fit
    has its term."""
    fixed, per_seq, per_mib, per_token, *write = fit.coefficients
    costs = replace(
        costs,
        step_ms=fixed,
        step_per_seq_ms=per_seq,
        step_per_adapter_mib_ms=per_mib,
        step_lora_ms=0.0,  # the fitted line's fixed part holds it
        prefill_per_token_ms=per_token,
        source=source,
    )
    return replace(costs, write_ms=write[0], write_per_mib_ms=0.0) if write else costs


@dataclass(frozen=True)
class Calibration:
    costs: Costs
    step_fit: Fit
    read_fit: Fit
    write_fit: Fit

    def summary(self) -> str:
        c, s = self.costs, self.step_fit
        return "\n".join(
            [
                f"step ms = {c.step_ms:.3f} + {c.step_per_seq_ms:.4f} x sequences "
                f"+ {c.step_per_adapter_mib_ms:.4f} x adapter MiB + {c.prefill_per_token_ms:.4f} x "
                f"prefill tokens",
                f"  fit over {s.samples} steps: RMS error {s.rms_ms:.2f} ms, "
                f"{100 * s.rms_relative:.1f}% RMS relative, worst {100 * s.worst_relative:.0f}%",
                f"read ms = {c.read_ms:.3f} + {c.read_per_mib_ms:.4f} x MiB "
                f"(RMS {100 * self.read_fit.rms_relative:.0f}%); write ms = {c.write_ms:.3f} + "
                f"{c.write_per_mib_ms:.4f} x MiB (RMS {100 * self.write_fit.rms_relative:.0f}%)",
                f"adapter MiB (mean) = {c.adapter_mib:.3f}",
            ]
        )


def measure_steps(
    llm: LLM,
    adapter_ids: Sequence[str],
    batches: Sequence[int] = BATCHES,
    adapters_per_batch: Sequence[int] = ADAPTERS_PER_BATCH,
    prompt_tokens: Sequence[int] = PROMPT_TOKENS,
    new_tokens: int = 16,
    repeats: int = 2,
    seed: int = 0,
) -> list[StepRecord]:
    """Every step of batches of each size, over each number of adapters, with each prompt
    length, all adapters resident: each batch run ``repeats`` times, each of its steps the
    median of its runs (a step that another process slowed down does not skew the fit)."""
    rng = random.Random(seed)
    _make_resident(llm, adapter_ids)
    samples = []
    for batch in batches:
        for count in (k for k in adapters_per_batch if k <= min(batch, len(adapter_ids))):
            for length in prompt_tokens:
                adapters = [adapter_ids[i % count] if count else None for i in range(batch)]
                runs = [_run_batch(llm, rng, adapters, length, new_tokens) for _ in range(repeats)]
                for steps in zip(*runs, strict=False):
                    if len({(s.seqs, s.adapter_bytes, s.prefill_tokens) for s in steps}) == 1:
                        seconds = statistics.median(s.seconds for s in steps)
                        samples.append(replace(steps[0], seconds=seconds))
    return samples


def _run_batch(
    llm: LLM, rng: random.Random, adapters: Sequence[str | None], length: int, new_tokens: int
) -> list[StepRecord]:
    """Prompts of ``length`` random tokens, one per adapter of ``adapters``, arriving one a step
    as in serving (each prefill joins the decodes of those before it), run to the end; the
    engine's record of each step that loaded no adapter."""
    from lora_guard.engine import SamplingParams

    engine, vocab = llm.engine, len(llm.tokenizer)
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    tag = f"calibrate-{rng.getrandbits(48):x}"
    added, samples = 0, []
    while added < len(adapters) or engine.has_unfinished_requests():
        if added < len(adapters):
            prompt = [rng.randrange(3, vocab) for _ in range(length)]
            engine.add_request(f"{tag}-{added}", prompt, params, adapters[added])
            added += 1
        steps = engine.stats.steps
        engine.step()
        if engine.stats.steps > steps and not engine.stats.recent_steps[-1].loads:
            samples.append(engine.stats.recent_steps[-1])
    return samples


def measure_loads(llm: LLM, adapter_ids: Sequence[str], repeats: int = 3) -> list[LoadSample]:
    """Each adapter read from its folder, and written into the pool over itself evicted (the
    median of ``repeats``)."""
    samples = []
    for adapter_id in adapter_ids:
        _make_resident(llm, [adapter_id])
        timings = [llm.engine.time_reload(adapter_id) for _ in range(repeats)]
        samples.append(
            LoadSample(
                timings[0].mib,
                statistics.median(t.read_ms for t in timings),
                statistics.median(t.write_ms for t in timings),
            )
        )
    return samples


def calibrate(llm: LLM, adapter_ids: Sequence[str], **steps: Any) -> Calibration:
    """Measure ``llm``'s loads of each of ``adapter_ids`` and its steps over the first of them
    (as many as the most adapters a batch mixes: the engine needs that many seats), and fit the
    simulator's costs to them. ``steps`` go to :func:`measure_steps`."""
    mixed = max(steps.get("adapters_per_batch", ADAPTERS_PER_BATCH))
    step_fit = fit_steps(measure_steps(llm, adapter_ids[:mixed], **steps))
    load_samples = measure_loads(llm, adapter_ids)
    read_fit = fit_line(
        [(1, s.adapter_mib) for s in load_samples], [s.read_ms for s in load_samples]
    )
    write_fit = fit_line(
        [(1, s.adapter_mib) for s in load_samples], [s.write_ms for s in load_samples]
    )
    loads = Costs(
        read_ms=read_fit.coefficients[0],
        read_per_mib_ms=read_fit.coefficients[1],
        write_ms=write_fit.coefficients[0],
        write_per_mib_ms=write_fit.coefficients[1],
        adapter_mib=statistics.mean(s.adapter_mib for s in load_samples),
    )
    costs = with_step_fit(loads, step_fit, "calibrated in this process")
    return Calibration(costs, step_fit, read_fit, write_fit)


def calibrate_serve(
    serve_argv: Sequence[str], adapter_ids: Sequence[str], threads: int = 1, **steps: Any
) -> Costs:
    """The costs of the engine that ``lora-guard serve SERVE_ARGV`` (and each ``serve-ray``
    replica) runs: its settings, ``threads`` torch threads, measured in this process (see
    :func:`calibrate`)."""
    import torch

    from lora_guard.config import load_settings
    from lora_guard.engine import LLM

    torch.set_num_threads(threads)
    settings = load_settings(list(serve_argv))
    llm = LLM(
        **settings.engine_kwargs(),
        policies=list(settings.policies),
        settings=settings.plugin_settings(),
    )
    try:
        return calibrate(llm, adapter_ids, **steps).costs
    finally:
        llm.engine.shutdown()


def write_costs(calibration: Calibration, path: Path, about: dict[str, Any]) -> None:
    costs = {
        f.name: getattr(calibration.costs, f.name) for f in fields(Costs) if f.name != "source"
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        json.dumps(
            {
                **about,
                "costs_ms": costs,
                "step_fit": asdict(calibration.step_fit),
                "read_fit": asdict(calibration.read_fit),
                "write_fit": asdict(calibration.write_fit),
            },
            indent=2,
        )
        + "\n"
    )


def read_costs(path: Path) -> Costs:
    """The costs of a file ``write_costs`` wrote."""
    data = json.loads(path.read_text())
    return Costs(
        **data["costs_ms"],
        source=f"{path.name} ({data.get('model', 'a model')}, "
        f"{data.get('device', '?')}, {data.get('dtype', '?')})",
    )


def calibrate_command(
    out: Path, model: Path | None, adapter_dir: Path | None, device: str, dtype: str
) -> int:
    """``lora-guard simulate --calibrate OUT.json``: measure, print the fit, write the costs."""
    import torch

    from lora_guard.engine import LLM
    from lora_guard.engine.lora.registry import scan_adapter_dir

    if model is None:
        from lora_guard.demo.model import prepare_demo

        model = prepare_demo(log=lambda _msg: None).model_dir
    with tempfile.TemporaryDirectory(prefix="lora-guard-calibrate-") as scratch:
        if adapter_dir is None:
            from lora_guard.demo.adapters import make_adapters

            adapter_dir = Path(scratch)
            make_adapters(
                model,
                adapter_dir,
                n=max(ADAPTERS_PER_BATCH),
                ranks=(8, 16, 32),
                prefix="calibrate",
                all_projections=True,
            )
        ids = [a for a, _ in scan_adapter_dir(adapter_dir)][: max(ADAPTERS_PER_BATCH)]
        llm = LLM(
            model,
            adapters={a: adapter_dir / a for a in ids},
            max_loras=len(ids),
            cache_memory="1GiB",
            dtype=dtype,
            device=device,
            max_num_seqs=max(BATCHES),
            policies="lru",
        )
        started, load_before = timer(), os.getloadavg()[0]
        calibration = calibrate(llm, ids)
        model_id = llm.engine.model_id
        llm.engine.shutdown()
    about = {
        "command": f"lora-guard simulate --calibrate {out.name if out.is_absolute() else out}",
        "model": model_id,
        "device": device,
        "dtype": dtype,
        "torch_threads": torch.get_num_threads(),
        "cpus": os.cpu_count(),
        "adapters": len(ids),
        "load_average_1min": [round(load_before, 2), round(os.getloadavg()[0], 2)],  # before, after
    }
    write_costs(calibration, out, about)
    print(calibration.summary())
    print(f"wrote {out} in {timer() - started:.0f} s")
    return 0


def _make_resident(llm: LLM, adapter_ids: Sequence[str]) -> None:
    from lora_guard.engine import SamplingParams

    llm.generate(
        ["Warm-up."] * len(adapter_ids),
        SamplingParams(max_new_tokens=1, ignore_eos=True),
        list(adapter_ids),
    )
    missing = [a for a in adapter_ids if a not in llm.engine.figures().resident]
    if missing:
        raise ValueError(f"calibration needs every adapter resident at once; not: {missing}")
