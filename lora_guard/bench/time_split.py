"""Where a sweep point's request time went, for a server that logs its side (lora-guard's
``--request-log``): each request's time as its client saw it (sent to last event) split into
the server's queue, engine steps, engine time between those steps and HTTP, and the rest, the
client's (connecting, sending, reading the stream). Parts are summed over the point's requests
and given as shares of their summed time, beside the mean request time."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from lora_guard.bench.load import RequestRecord

SERVER_PARTS = ("queue_s", "step_s", "between_steps_s", "http_s")


class RequestLogReader:
    """The lines a server appended to its request log since the last read."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset = path, 0

    def skip(self) -> None:
        """Forget what is there now (a warm-up's requests)."""
        self.offset = self.path.stat().st_size if self.path.exists() else 0

    def new_lines(self) -> dict[str, dict[str, Any]]:
        """The lines written since the last read, by the client's request id."""
        if not self.path.exists():
            return {}
        with self.path.open() as log:
            log.seek(self.offset)
            text = log.read()
        whole = text[: text.rfind("\n") + 1]  # a line still being written waits for the next read
        self.offset += len(whole.encode())
        lines = (json.loads(line) for line in whole.splitlines() if line.strip())
        return {line["id"]: line for line in lines}


def time_split(
    replies: list[RequestRecord], lines: dict[str, dict[str, Any]]
) -> dict[str, float] | None:
    """Shares of the point's summed request time (queue, steps, between_steps, http, client),
    the mean request time in ms and the requests joined; None when no reply has a line."""
    sums = dict.fromkeys([*SERVER_PARTS, "client_s"], 0.0)
    total, joined = 0.0, 0
    for reply in replies:
        line = lines.get(reply.id)
        if line is None or reply.error is not None or reply.sent is None or reply.finish is None:
            continue
        seen = reply.finish - reply.sent
        for part in SERVER_PARTS:
            sums[part] += line[part]
        sums["client_s"] += max(seen - line["total_s"], 0.0)
        total += max(seen, line["total_s"])
        joined += 1
    if not joined or total <= 0:
        return None
    shares = {part.removesuffix("_s"): value / total for part, value in sums.items()}
    return {**shares, "request_ms": 1000 * total / joined, "requests": joined}


def split_text(split: dict[str, float]) -> str:
    """A point's split in a line: each part's share and the mean request time."""
    parts = ("queue", "step", "between_steps", "http", "client")
    names = {"step": "steps", "between_steps": "between steps", "http": "HTTP"}
    shares = ", ".join(f"{names.get(p, p)} {100 * split[p]:.0f}%" for p in parts)
    return f"{shares} of {split['request_ms']:.0f} ms a request"
