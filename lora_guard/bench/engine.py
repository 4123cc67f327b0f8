"""Engine speed on one machine, as ratios from one run.

    python -m lora_guard.bench.engine [--model DIR --adapter-dir DIR] [--batches 1,8,32]
                                      [--adapter-ids ID,ID] [--repeats N]

Prints, for batch sizes 1, 8 and 32: the engine's decode step time for the base model alone and for
a batch mixing 8 adapters (each the median of three runs, base and mixed in turn); the bytes floor
of that mix (a step must read the base weights, all but the embedding table it only gathers from,
and, for a mixed batch, every adapter's weights once: (base bytes + adapter bytes) / base bytes);
the same prompts through transformers + PEFT mixed-adapter ``generate``; and this machine's torch
matmul peak. Defaults to the demo model (prepared if missing) with 8 adapters made for the run
(ranks 8, 16 and 32 on every projection, seeded), float32. With ``--repeats N`` the engine's and
PEFT's runs take turns N times (a drift of the machine's speed reaches both), and each figure is
the median of its runs, each run's ratios printed below the table.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import statistics
import sys
import tempfile
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch

from lora_guard.bench.engine_runs import batch_prompts, engine_run, matmul_peak_gflops, peft_run
from lora_guard.config import add_engine_flags, engine_names
from lora_guard.engine import LLM, SamplingParams
from lora_guard.engine.lora.registry import scan_adapter_dir

TURNS = 3  # base and mixed runs of each batch, in turn, within one engine


@dataclass
class Row:
    batch: int
    bytes_floor: float  # (base bytes + the batch's adapter bytes) / base bytes
    engine_base_step_ms: float
    engine_mixed_step_ms: float
    engine_mixed_tokens_per_s: float
    engine_mixed_prefill_ms: float  # the batch's prompts, until every request decodes
    peft_base_step_ms: float
    peft_mixed_step_ms: float
    peft_mixed_tokens_per_s: float
    peft_mixed_prefill_ms: float  # generate() of one new token: the prompts' prefill
    over_floor_runs: tuple[float, ...] = ()  # each run's mixed / floor (``--repeats``)
    speedup_runs: tuple[float, ...] = ()  # each run's engine / PEFT tokens/s

    @property
    def mixed_over_base(self) -> float:
        return self.engine_mixed_step_ms / self.engine_base_step_ms

    @property
    def over_floor(self) -> float:
        if self.over_floor_runs:
            return statistics.median(self.over_floor_runs)
        return self.mixed_over_base / self.bytes_floor

    @property
    def speedup_over_peft(self) -> float:
        if self.speedup_runs:
            return statistics.median(self.speedup_runs)
        return self.engine_mixed_tokens_per_s / self.peft_mixed_tokens_per_s


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m lora_guard.bench.engine",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    # The engine's flags as `lora-guard serve` has them, but on the CPU in float32 (where serve
    # picks by the machine: one run's figures comparable with the next's) and with prefix caching
    # off (PEFT computes every prompt; --prefix-caching lets the engine reuse what it saw before).
    add_engine_flags(
        parser,
        [
            "model",
            "dtype",
            "lora_dtype",
            "lora_compute",
            "weight_layout",
            "device",
            "enable_prefix_caching",
        ],
        defaults={"dtype": "float32", "device": "cpu", "enable_prefix_caching": False},
    )
    parser.add_argument(
        "--adapter-dir",
        type=Path,
        help="adapters (default: 8 made for the run, ranks 8-32, every projection)",
    )
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--adapters", type=int, default=8, help="adapters mixed in a batch")
    parser.add_argument(
        "--adapter-ids",
        help="the adapters mixed in a batch, by id, comma "
        "separated (default: the first --adapters of the folder)",
    )
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--skip-peft", action="store_true", help="engine figures only")
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="runs of each batch, the engine and PEFT in turn; medians printed, "
        "and the ratios' ranges",
    )
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    # torch and PEFT are handed them by name: auto's, too.
    args.device, args.dtype = engine_names(args.device, args.dtype)

    if args.model is None:
        from lora_guard.demo.model import prepare_demo

        args.model = prepare_demo(log=lambda _msg: None).model_dir
    args.model = Path(args.model)
    if args.adapter_dir is not None:
        return _bench(args)
    from lora_guard.demo.adapters import make_adapters

    with tempfile.TemporaryDirectory(prefix="lora-guard-bench-") as scratch:
        args.adapter_dir = Path(scratch)
        make_adapters(
            args.model,
            args.adapter_dir,
            n=args.adapters,
            ranks=(8, 16, 32),
            prefix="bench",
            all_projections=True,
        )
        return _bench(args)


def _bench(args: argparse.Namespace) -> int:
    from transformers import AutoTokenizer

    names = [adapter_id for adapter_id, _ in scan_adapter_dir(args.adapter_dir)][: args.adapters]
    if args.adapter_ids:
        served = {adapter_id for adapter_id, _ in scan_adapter_dir(args.adapter_dir)}
        names = [n.strip() for n in args.adapter_ids.split(",") if n.strip()]
        missing = [n for n in names if n not in served]
        if missing or not names:
            print(
                f"error: no adapter {missing[0] if missing else ''!r} in {args.adapter_dir}",
                file=sys.stderr,
            )
            return 2
    batches = [int(b) for b in args.batches.split(",")]
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    nan = (float("nan"),) * 4
    runs: dict[int, list[Row]] = {b: [] for b in batches}
    # The engine and PEFT in turn, each freed before the other is built (in one process, one
    # slows the other down): a drift of the machine's speed reaches both.
    for _ in range(args.repeats):
        engine = _engine_figures(args, names, batches, tokenizer)
        peft = {} if args.skip_peft else _peft_figures(args, names, batches, tokenizer)
        for b in batches:
            runs[b].append(Row(b, *engine[b], *peft.get(b, nan)))
    rows = [_median_row(runs[b]) for b in batches]
    device = torch.device(args.device)
    peak = matmul_peak_gflops(getattr(torch, args.dtype), device)
    _print(rows, peak, args, names)
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "device": str(device),
                    "dtype": args.dtype,
                    "lora_dtype": args.lora_dtype,
                    "weight_layout": args.weight_layout,
                    "lora_compute": args.lora_compute,
                    "matmul_peak_gflops": peak,
                    "adapters": names,
                    "new_tokens": args.new_tokens,
                    "repeats": args.repeats,
                    "prefix_caching": args.prefix_caching,
                    "rows": [
                        {
                            k: _json_value(v)
                            for k, v in (
                                asdict(r)
                                | {
                                    "mixed_over_base": r.mixed_over_base,
                                    "over_floor": r.over_floor,
                                    "speedup_over_peft": r.speedup_over_peft,
                                }
                            ).items()
                        }
                        for r in rows
                    ],
                },
                indent=2,
            )
            + "\n"
        )
    return 0


def _engine_figures(
    args: argparse.Namespace, names: list[str], batches: list[int], tokenizer: Any
) -> dict[int, tuple[float, float, float, float, float]]:
    """Per batch: the bytes floor, the engine's base and mixed step ms, its mixed tokens/s and
    prefill ms."""
    llm = LLM(
        args.model,
        adapters={n: args.adapter_dir / n for n in names},
        max_loras=len(names),
        cache_memory="1GiB",
        dtype=args.dtype,
        device=args.device,
        max_num_seqs=max(batches),
        lora_compute=args.lora_compute,
        weight_layout=args.weight_layout,
        lora_dtype=args.lora_dtype,
        enable_prefix_caching=args.prefix_caching,
    )
    engine = llm.engine
    base_bytes = engine.step_bytes()
    adapter_bytes = {
        n: engine.adapter_page_bytes(engine.read_adapter(n, args.adapter_dir / n)) for n in names
    }
    # Warm-up: every adapter read and resident before anything is timed.
    llm.generate(
        batch_prompts(tokenizer, len(names)), SamplingParams(max_new_tokens=4), list(names)
    )
    figures = {}
    for batch in batches:
        prompts = batch_prompts(tokenizer, batch)
        mixed = [names[i % len(names)] for i in range(batch)]
        # Base and mixed batches in turn: a drift of the machine's speed reaches both.
        base, mixed_runs = [], []
        for _ in range(TURNS):
            base.append(engine_run(llm, prompts, [None] * batch, args.new_tokens))
            mixed_runs.append(engine_run(llm, prompts, list(mixed), args.new_tokens))
        base_ms = statistics.median(ms for ms, _, _ in base)
        mixed_ms = statistics.median(ms for ms, _, _ in mixed_runs)
        mixed_tps = statistics.median(tps for _, tps, _ in mixed_runs)
        prefill_ms = statistics.median(ms for _, _, ms in mixed_runs)
        floor = (base_bytes + sum(adapter_bytes[n] for n in set(mixed))) / base_bytes
        figures[batch] = (floor, base_ms, mixed_ms, mixed_tps, prefill_ms)
    engine.shutdown()
    del llm, engine
    gc.collect()
    return figures


def _peft_figures(
    args: argparse.Namespace, names: list[str], batches: list[int], tokenizer: Any
) -> dict[int, tuple[float, float, float, float]]:
    """Per batch: transformers + PEFT's base and mixed step ms, its mixed tokens/s and prefill
    ms."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, args.dtype))
    # the adapters in the model's dtype, as the engine keeps them (PEFT's default keeps float16
    # and bfloat16 adapters in float32)
    model = PeftModel.from_pretrained(
        base.to(args.device),
        str(args.adapter_dir / names[0]),
        adapter_name=names[0],
        autocast_adapter_dtype=False,
    )
    for name in names[1:]:
        model.load_adapter(
            str(args.adapter_dir / name), adapter_name=name, autocast_adapter_dtype=False
        )
    model.eval()
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    figures = {}
    for batch in batches:
        prompts = batch_prompts(tokenizer, batch)
        mixed = [names[i % len(names)] for i in range(batch)]
        base_ms, _, _ = peft_run(model, prompts, ["__base__"] * batch, args.new_tokens, pad)
        figures[batch] = (base_ms, *peft_run(model, prompts, mixed, args.new_tokens, pad))
    del model, base
    gc.collect()
    return figures


def _median_row(runs: list[Row]) -> Row:
    """Each figure the median of its runs; the two ratios the medians of each run's ratio,
    with their ranges."""
    ratios = ("over_floor_runs", "speedup_runs")
    median = Row(
        **{
            f.name: statistics.median(getattr(r, f.name) for r in runs)
            for f in fields(Row)
            if f.name not in ratios
        }
    )
    median.over_floor_runs = tuple(r.over_floor for r in runs)
    median.speedup_runs = tuple(r.speedup_over_peft for r in runs)
    return median


def _print(rows: list[Row], peak: float, args: argparse.Namespace, names: list[str]) -> None:
    print(
        f"device {args.device}, {args.dtype} (adapter pages {args.lora_dtype}), weight layout "
        f"{args.weight_layout}, LoRA compute "
        f"{args.lora_compute}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads; matmul peak {peak:.0f} GFLOP/s"
    )
    caching = "on (prompts seen before are cached)" if args.prefix_caching else "off"
    print(
        f"mixed batches cycle over {len(names)} adapters: {', '.join(names)}; "
        f"{args.new_tokens} new tokens per request; the engine's prefix caching "
        f"{caching}\n"
    )
    print(
        "| batch | engine base step ms | engine mixed step ms | mixed / base | bytes floor "
        "| mixed / floor | PEFT base step ms | PEFT mixed step ms | engine mixed tok/s "
        "| PEFT mixed tok/s | engine / PEFT tok/s | engine prefill ms "
        "| PEFT prefill ms |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r.batch} | {r.engine_base_step_ms:.1f} | {r.engine_mixed_step_ms:.1f} "
            f"| {r.mixed_over_base:.2f}x | {r.bytes_floor:.2f}x | {r.over_floor:.2f}x "
            f"| {_cell(r.peft_base_step_ms, '.1f')} "
            f"| {_cell(r.peft_mixed_step_ms, '.1f')} "
            f"| {r.engine_mixed_tokens_per_s:.1f} | {_cell(r.peft_mixed_tokens_per_s, '.1f')} "
            f"| {_cell(r.speedup_over_peft, '.2f', 'x')} | {r.engine_mixed_prefill_ms:.0f} "
            f"| {_cell(r.peft_mixed_prefill_ms, '.0f')} |"
        )
    if args.repeats > 1:
        print(f"\nmedians of {args.repeats} runs; each run's ratios:")
        for r in rows:
            print(
                f"batch {r.batch}: mixed / floor {_ratios(r.over_floor_runs)}; engine / PEFT "
                f"tok/s {_ratios(r.speedup_runs)}"
            )


def _ratios(values: tuple[float, ...]) -> str:
    return ", ".join(_cell(v, ".2f", "x") for v in values)


def _cell(value: float, spec: str, unit: str = "") -> str:
    """``value`` as ``spec`` says, or "-" where it was not measured (NaN: ``--skip-peft``)."""
    return "-" if math.isnan(value) else f"{value:{spec}}{unit}"


def _json_value(value: Any) -> Any:
    """NaN (not measured) as null, which JSON has; tuples of runs likewise."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, tuple):
        return [_json_value(v) for v in value]
    return value


if __name__ == "__main__":
    sys.exit(main())
