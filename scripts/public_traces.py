"""Rebuild the public traces ``--scenario public`` draws from (lora_guard/workload/public_data/)
out of the original files:

    python scripts/public_traces.py \
        --azure-conv AzurePublicDataset/data/AzureLLMInferenceTrace_conv.csv \
        --alibaba clusterdata/cluster-trace-v2026-GenAI/data_trace_processed.tar.gz \
        --servegen ServeGen/data/language/m-large

- ``azure_conv.csv.gz``: every request of the Azure LLM inference trace 2023 (conversation):
  milliseconds from the first request, ``ContextTokens``, ``GeneratedTokens``.
- ``alibaba_lora.csv.gz``: the LoRA requests of the base model with the most of them in Alibaba's
  GenAI trace (2026), in the file's order, each as its first LoRA's popularity rank (0: the most
  requested; ties by first appearance).
- ``servegen_m_large.csv``: each ServeGen ``m-large`` client's mean rate over its trace, in
  requests a second, busiest first.

The gzip files carry no time stamp, so a rebuild from the same originals gives the same bytes.
"""

from __future__ import annotations

import argparse
import ast
import csv
import gzip
import io
import tarfile
from collections import Counter
from collections.abc import Iterable, Iterator
from datetime import datetime
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "lora_guard" / "workload" / "public_data"


def azure_rows(path: Path) -> list[tuple[int, int, int]]:
    """(ms from the first request, context tokens, generated tokens) of each request."""
    with path.open(newline="") as f:
        rows = list(csv.DictReader(f))
    # TIMESTAMP has seven fractional digits; fromisoformat takes six.
    times = [datetime.fromisoformat(r["TIMESTAMP"][:26]) for r in rows]
    first = times[0]
    return [
        (
            round((t - first).total_seconds() * 1000),
            int(r["ContextTokens"]),
            int(r["GeneratedTokens"]),
        )
        for t, r in zip(times, rows, strict=True)
    ]


def alibaba_lines(path: Path) -> Iterator[str]:
    """The lines of ``data_trace_processed.csv``, from the tarball or the extracted file."""
    if path.suffix == ".csv":
        with path.open(newline="") as f:
            yield from f
        return
    with tarfile.open(path) as tar:
        member = next(
            m for m in tar.getmembers() if m.name.split("/")[-1] == "data_trace_processed.csv"
        )
        raw = tar.extractfile(member)
        assert raw is not None
        yield from io.TextIOWrapper(raw, newline="")


def alibaba_ranks(lines: Iterable[str]) -> tuple[str, list[int]]:
    """The base model with the most LoRA requests, and those requests' first LoRA as ranks."""
    by_base: dict[str, list[str]] = {}
    for row in csv.DictReader(lines):
        loras = ast.literal_eval(row["lora_args"]) if row["lora_args"] else []
        if loras:
            by_base.setdefault(row["checkpoint_model_version_id"], []).append(
                loras[0]["modelVersionId"]
            )
    base, sequence = max(by_base.items(), key=lambda kv: len(kv[1]))
    counts = Counter(sequence)
    first_seen = {lora: i for i, lora in reversed(list(enumerate(sequence)))}
    order = sorted(counts, key=lambda lora: (-counts[lora], first_seen[lora]))
    rank = {lora: i for i, lora in enumerate(order)}
    return base, [rank[lora] for lora in sequence]


def servegen_rates(folder: Path) -> list[tuple[int, float]]:
    """(client, mean rate) of each ``chunk-N-trace.csv`` (rows: window start, rate, ...), the
    busiest first."""
    rates = []
    for path in folder.glob("chunk-*-trace.csv"):
        client = int(path.name.split("-")[1])
        with path.open(newline="") as f:
            windows = [float(row[1]) for row in csv.reader(f)]
        rates.append((client, sum(windows) / len(windows)))
    return sorted(rates, key=lambda cr: (-cr[1], cr[0]))


def write_gzip_csv(path: Path, header: str, rows: Iterable[Iterable[object]]) -> None:
    text = header + "\n" + "".join(",".join(map(str, row)) + "\n" for row in rows)
    with path.open("wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as f:
        f.write(text.encode())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--azure-conv", type=Path, required=True, help="AzureLLMInferenceTrace_conv.csv"
    )
    parser.add_argument(
        "--alibaba", type=Path, required=True, help="data_trace_processed.tar.gz (or its .csv)"
    )
    parser.add_argument(
        "--servegen", type=Path, required=True, help="ServeGen's data/language/m-large folder"
    )
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    azure = azure_rows(args.azure_conv)
    write_gzip_csv(args.out / "azure_conv.csv.gz", "ms,context_tokens,generated_tokens", azure)
    print(f"azure_conv.csv.gz: {len(azure)} requests over {azure[-1][0] / 1000:.0f} s")

    base, ranks = alibaba_ranks(alibaba_lines(args.alibaba))
    write_gzip_csv(args.out / "alibaba_lora.csv.gz", "adapter_rank", ([r] for r in ranks))
    print(f"alibaba_lora.csv.gz: base model {base}: {len(ranks)} requests, {len(set(ranks))} LoRAs")

    clients = servegen_rates(args.servegen)
    with (args.out / "servegen_m_large.csv").open("w") as f:
        f.write("client,mean_rate\n")
        f.writelines(f"{client},{rate:.6g}\n" for client, rate in clients)
    print(f"servegen_m_large.csv: {len(clients)} clients")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
