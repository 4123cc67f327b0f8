"""Adapter faults injected on disk under a running server: each request for the broken adapter
gets 424 with the reason, ``cold_loads_total{outcome="failed"}`` counts it, nothing outside the
adapter directory is read, no pickle is ever loaded, and every other adapter still answers the
in-process engine's tokens."""

from __future__ import annotations

import os
import pickle
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from lora_guard.demo.scrape import metric
from lora_guard.demo.testing import ServerProcess, start_server

WEIGHTS = "adapter_model.safetensors"
CONFIG = "adapter_config.json"
PROMPT = "The capital of France is"
ServesCorrectly = Callable[..., None]


class Store:
    """A server over a copy of the tiny adapters, plus spare copies to break."""

    def __init__(self, server: ServerProcess, adapters: Path, outside: Path, log: Path) -> None:
        self.server, self.adapters, self.outside, self.log = server, adapters, outside, log

    def generate(self, adapter: str, max_new_tokens: int = 8) -> httpx.Response:
        body = {
            "inputs": PROMPT,
            "parameters": {"max_new_tokens": max_new_tokens, "adapter_id": adapter},
        }
        return httpx.post(self.server.url + "/generate", json=body, timeout=60)

    def failed_loads(self) -> float:
        return metric(self.server.url, "lora_guard_cold_loads_total", outcome="failed")

    def evict(self, adapter: str) -> None:
        """Push ``adapter`` out of its device slot and host memory (2 of each): use 3 others."""
        for other in ("a-00", "a-01", "a-02"):
            assert self.generate(other).status_code == 200
        rows = httpx.get(self.server.url + "/v1/adapters", timeout=10).json()
        assert {r["id"]: r["tier"] for r in rows}[adapter] == "disk"


def payload_pickle(canary: Path) -> bytes:
    """A pickle that creates ``canary`` if anyone ever unpickles it."""

    class Payload:
        def __reduce__(self) -> tuple[object, tuple[str, str]]:
            return open, (str(canary), "w")

    return pickle.dumps(Payload())


@pytest.fixture(scope="module")
def store(tiny: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Store]:
    model, tiny_adapters = tiny
    root = tmp_path_factory.mktemp("adapter-faults")
    adapters, outside = root / "adapters", root / "outside"
    shutil.copytree(tiny_adapters, adapters)
    shutil.copytree(tiny_adapters / "a-02", outside / "a-02")  # a valid adapter, elsewhere
    for name in [*INJURIES, "in-use-deleted", "in-use-swapped", "in-use-truncated", "both"]:
        shutil.copytree(tiny_adapters / "a-01", adapters / name)
    server = start_server(
        model,
        adapters,
        "--cold-loads-per-minute",
        "1000",
        "--max-loras",
        "2",
        "--max-cpu-loras",
        "2",
        "--hot-set-size",
        "0",
        log=root / "server.log",
    )
    yield Store(server, adapters, outside, root / "server.log")
    assert server.stop() == 0


def _corrupt(folder: Path, _: Path) -> None:
    (folder / WEIGHTS).write_bytes(os.urandom(4096))


def _truncate(folder: Path, _: Path) -> None:
    data = (folder / WEIGHTS).read_bytes()
    (folder / WEIGHTS).write_bytes(data[: len(data) // 2])


def _pickle_alone(folder: Path, outside: Path) -> None:
    (folder / WEIGHTS).unlink()
    (folder / "adapter_model.bin").write_bytes(payload_pickle(outside / "canary"))


def _directory_in_place(folder: Path, _: Path) -> None:
    (folder / WEIGHTS).unlink()
    (folder / WEIGHTS).mkdir()


def _pipe_in_place(folder: Path, _: Path) -> None:
    (folder / WEIGHTS).unlink()
    os.mkfifo(folder / WEIGHTS)  # reading it would wait forever for a writer


def _file_link_outside(folder: Path, outside: Path) -> None:
    (folder / WEIGHTS).unlink()
    (folder / WEIGHTS).symlink_to(outside / "a-02" / WEIGHTS)


def _folder_link_outside(folder: Path, outside: Path) -> None:
    shutil.rmtree(folder)
    folder.symlink_to(outside / "a-02")


def _device_link(folder: Path, _: Path) -> None:
    (folder / WEIGHTS).unlink()
    (folder / WEIGHTS).symlink_to("/dev/zero")  # endless, if it were read


INJURIES: dict[str, tuple[Callable[[Path, Path], None], str]] = {
    "corrupt": (_corrupt, "adapter_model.safetensors is corrupt or truncated"),
    "truncated": (_truncate, "adapter_model.safetensors is corrupt or truncated"),
    "no-config": (lambda f, _: (f / CONFIG).unlink(), "missing adapter_config.json"),
    "no-weights": (lambda f, _: (f / WEIGHTS).unlink(), "missing adapter_model.safetensors"),
    "bad-config": (lambda f, _: (f / CONFIG).write_text("{"), "is not valid JSON"),
    "pickle-alone": (_pickle_alone, "holds only pickle weights (adapter_model.bin)"),
    "deleted": (lambda f, _: shutil.rmtree(f), "is not a folder"),
    "directory-in-place": (_directory_in_place, "adapter_model.safetensors is not a regular"),
    "pipe-in-place": (_pipe_in_place, "adapter_model.safetensors is not a regular file"),
    "device-link": (_device_link, "leads outside the adapter directory"),
    "file-link-outside": (_file_link_outside, "leads outside the adapter directory"),
    "folder-link-outside": (_folder_link_outside, "leads outside the adapter directory"),
}


@pytest.mark.parametrize("injury", INJURIES)
def test_a_broken_adapter_fails_its_requests_with_424_and_the_reason(
    store: Store, injury: str, serves_correctly: ServesCorrectly
) -> None:
    injure, reason = INJURIES[injury]
    injure(store.adapters / injury, store.outside)
    failed = store.failed_loads()
    r = store.generate(injury)
    assert r.status_code == 424, r.text
    assert r.json()["error_type"] == "generation"
    assert f"adapter '{injury}'" in r.json()["error"] and reason in r.json()["error"]
    assert store.failed_loads() == failed + 1
    assert not (store.outside / "canary").exists()  # no pickle was ever loaded
    serves_correctly(store.server.url, adapters=[None, "a-00", "a-01"])


def test_a_folder_with_safetensors_and_a_pickle_serves_and_never_opens_the_pickle(
    store: Store, expected: dict[tuple[str, str | None], list[int]]
) -> None:
    # Many adapter repositories ship both files. Here the pickle is a named pipe: opening it to
    # read would block the loader for good, so an answer at all proves it was never opened.
    folder = store.adapters / "both"  # a copy of a-01
    os.mkfifo(folder / "adapter_model.bin")
    (folder / "adapter.pt").write_bytes(payload_pickle(store.outside / "canary"))
    r = store.generate("both")
    assert r.status_code == 200, r.text
    assert [t["id"] for t in r.json()["details"]["tokens"]] == expected[PROMPT, "a-01"]
    assert not (store.outside / "canary").exists()
    said = [line for line in store.log.read_text().splitlines() if "adapter_model.bin" in line]
    assert len(said) == 1 and "never read" in said[0], said  # said once


def test_an_adapter_deleted_while_in_use_finishes_its_request_then_fails_with_424(
    store: Store, expected: dict[tuple[str, str | None], list[int]]
) -> None:
    name = "in-use-deleted"
    body = {"inputs": PROMPT, "parameters": {"max_new_tokens": 200, "adapter_id": name}}
    with httpx.stream("POST", store.server.url + "/generate_stream", json=body, timeout=60) as r:
        events = (line for line in r.iter_lines() if line.startswith("data:"))
        next(events)  # it runs, with the weights in its slot
        shutil.rmtree(store.adapters / name)
        last = list(events)[-1]
    assert '"generated_tokens": 200' in last or '"finish_reason": "eos_token"' in last, last
    store.evict(name)
    failed = store.failed_loads()
    r = store.generate(name)
    assert r.status_code == 424 and "is not a folder" in r.json()["error"], r.text
    assert store.failed_loads() == failed + 1
    tokens = [t["id"] for t in store.generate("a-01").json()["details"]["tokens"]]
    assert tokens == expected[PROMPT, "a-01"]


def test_an_adapter_replaced_on_disk_serves_the_new_weights_at_the_next_request(
    store: Store, expected: dict[tuple[str, str | None], list[int]]
) -> None:
    name = "in-use-swapped"  # a copy of a-01, replaced by a-02's files while resident
    assert [t["id"] for t in store.generate(name).json()["details"]["tokens"]] == expected[
        PROMPT, "a-01"
    ]
    changed = metric(store.server.url, "lora_guard_adapter_changed_on_disk_total")
    for file in (CONFIG, WEIGHTS):
        shutil.copyfile(store.adapters / "a-02" / file, store.adapters / name / file)
    r = store.generate(name)  # no eviction needed: the change is seen and the files read again
    assert r.status_code == 200, r.text
    # The new weights, and no KV cached under the old ones (same name, same prompt) reused.
    assert [t["id"] for t in r.json()["details"]["tokens"]] == expected[PROMPT, "a-02"]
    assert metric(store.server.url, "lora_guard_adapter_changed_on_disk_total") == changed + 1


def test_an_adapter_truncated_on_disk_fails_with_424_until_its_files_are_whole_again(
    store: Store, expected: dict[tuple[str, str | None], list[int]]
) -> None:
    name = "in-use-truncated"
    assert store.generate(name).status_code == 200
    whole = (store.adapters / name / WEIGHTS).read_bytes()
    failed = store.failed_loads()
    _truncate(store.adapters / name, store.outside)
    r = store.generate(name)  # the change is seen: read again, and refused
    assert r.status_code == 424 and "corrupt or truncated" in r.json()["error"], r.text
    assert store.failed_loads() == failed + 1
    (store.adapters / name / WEIGHTS).write_bytes(whole)  # the copy completes
    r = store.generate(name)
    assert r.status_code == 200, r.text
    assert [t["id"] for t in r.json()["details"]["tokens"]] == expected[PROMPT, "a-01"]
