"""The door's rejections reach the scheduler once each, and the file they pass through stays
empty between steps."""

from __future__ import annotations

import threading
from pathlib import Path

from lora_guard.vllm import channel


def test_taken_lines_leave_an_empty_file_and_come_once(tmp_path: Path) -> None:
    path = tmp_path / channel.REJECTS_FILE
    assert channel.take_lines(path) == []  # no file yet
    channel.append_line(path, {"request_id": "r1"})
    channel.append_line(path, {"request_id": "r2"})
    assert [line["request_id"] for line in channel.take_lines(path)] == ["r1", "r2"]
    assert path.stat().st_size == 0
    assert channel.take_lines(path) == []
    channel.append_line(path, {"request_id": "r3"})
    assert [line["request_id"] for line in channel.take_lines(path)] == ["r3"]


def test_no_line_is_lost_or_taken_twice_while_writers_append(tmp_path: Path) -> None:
    path = tmp_path / channel.REJECTS_FILE
    writers, each = 4, 500

    def write(writer: int) -> None:
        for n in range(each):
            channel.append_line(path, {"request_id": f"{writer}-{n}", "pad": "x" * 200})

    threads = [threading.Thread(target=write, args=(w,)) for w in range(writers)]
    for thread in threads:
        thread.start()
    taken: list[str] = []
    while any(t.is_alive() for t in threads):
        taken += [line["request_id"] for line in channel.take_lines(path)]
    taken += [line["request_id"] for line in channel.take_lines(path)]
    assert len(taken) == writers * each
    assert len(set(taken)) == writers * each
