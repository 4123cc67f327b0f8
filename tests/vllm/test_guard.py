"""The policies' view of vLLM's scheduler: seats as vLLM's worker fills them, hot-set's drain
holding back the new requests of the adapter an aged request displaces, reused prefix blocks
computed under other weights counted. Requests are stand-ins with vLLM's ``Request``
attributes; the scheduler inside a real vLLM is ``integration/test_vllm_scheduler.py``."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from lora_guard.plugins.manager import Hooks, make_plugin_manager
from lora_guard.vllm import channel
from lora_guard.vllm.guard import TENANT_ARG, SchedulerGuard
from lora_guard.vllm.worker_seats import Seats

NOW = 1_000.0
BLOCK = 16


def request(rid: str, adapter: str | None, arrival: float, path: str = "") -> Any:
    lora = None
    if adapter is not None:
        lora = SimpleNamespace(
            lora_name=adapter, lora_int_id=1 + hash(adapter) % 99, lora_path=path
        )
    return SimpleNamespace(
        request_id=rid,
        lora_request=lora,
        sampling_params=SimpleNamespace(extra_args={TENANT_ARG: adapter or "base"}),
        num_prompt_tokens=8,
        num_output_tokens=0,
        num_tokens=8,
        arrival_time=arrival,
        cache_salt=None,
        max_tokens=8,
    )


def guard(seats: int = 2, policies: str = "hot-set") -> SchedulerGuard:
    hooks = Hooks(make_plugin_manager(policies))
    hooks.configure({"max_loras": seats, "max_adapter_wait_s": 2.0})
    return SchedulerGuard(
        max_loras=seats,
        max_cpu_loras=seats,
        num_blocks=1000,
        block_size=BLOCK,
        hooks=hooks,
        clock=lambda: NOW,
    )


def test_seats_are_the_workers_least_recently_used_first_out() -> None:
    seats = Seats(2)
    assert seats.use({"a", "b"}, 1.0) == [("a", 0, None), ("b", 1, None)]
    assert seats.use({"b"}, 2.0) == []
    assert seats.use({"c"}, 3.0) == [("c", 0, "a")]  # a was used least recently
    assert list(seats.seat_of) == ["b", "c"]


def test_an_aged_request_drains_the_seat_it_takes_and_the_others_keep_coming() -> None:
    watch = guard()
    watch.device.use({"b1", "c1"}, NOW - 1)
    running = [request(f"run-{a}-{i}", a, NOW - 1) for a in ("b1", "c1") for i in range(2)]
    for _ in range(9):
        watch.arrived(request("heat", "b1", NOW))  # b1 is hotter than c1
    for _ in range(3):
        watch.arrived(request("heat", "c1", NOW))
    aged = request("aged-a2", "a2", NOW - 3)  # past max_adapter_wait_s
    waiting = [aged, request("new-b1", "b1", NOW - 0.2), request("new-c1", "c1", NOW)]
    assert watch.hold_back(waiting, running) == {"aged-a2", "new-c1"}


def test_reused_blocks_computed_under_other_weights_are_counted(tmp_path: Path) -> None:
    (tmp_path / "adapter_config.json").write_text("{}")
    (tmp_path / "adapter_model.safetensors").write_bytes(b"old weights")
    watch = guard()
    first = request("first", "a", NOW, str(tmp_path))
    again = request("again", "a", NOW, str(tmp_path))
    reloaded = request("reloaded", "a", NOW, str(tmp_path))
    requests = {r.request_id: r for r in (first, again, reloaded)}

    def schedule(r: Any, blocks: list[int], hits: int) -> None:
        new = SimpleNamespace(req_id=r.request_id, block_ids=(blocks,), num_computed_tokens=hits)
        output = SimpleNamespace(num_scheduled_tokens={r.request_id: 8}, scheduled_new_reqs=[new])
        watch.scheduled(output, requests, [r])

    schedule(first, [1, 2, 3], 0)
    schedule(again, [1, 2, 4], 2 * BLOCK)  # same weights: no conflict
    assert watch.kv_conflicts == 0 and watch.cached_tokens == 2 * BLOCK
    (tmp_path / "adapter_model.safetensors").write_bytes(b"new weights, same name and folder")
    schedule(reloaded, [1, 2, 5], 2 * BLOCK)
    assert watch.kv_conflicts == 2


def test_one_state_view_a_step_and_metrics_rendered_when_asked(tmp_path: Path) -> None:
    hooks = Hooks(make_plugin_manager("hot-set"))
    hooks.configure({"max_loras": 2})
    watch = SchedulerGuard(
        max_loras=2,
        max_cpu_loras=2,
        num_blocks=1000,
        block_size=BLOCK,
        hooks=hooks,
        folder=tmp_path,
        clock=time.time,
    )
    built = 0
    build = watch._build_state

    def counted(*args: Any) -> Any:
        nonlocal built
        built += 1
        return build(*args)

    watch._build_state = counted  # type: ignore[method-assign]
    running = [request("run", "a", NOW)]
    waiting = [request("wait", "b", NOW)]
    watch.hold_back(waiting, running)
    output = SimpleNamespace(
        num_scheduled_tokens={"run": 1}, scheduled_new_reqs=[], total_num_scheduled_tokens=1
    )
    watch.scheduled(output, {"run": running[0]}, running)
    built = 0
    watch.step_done(output, waiting, running)  # the view after the step...
    watch.hold_back(waiting, running)  # ...serves the next pass: nothing arrived since
    assert built == 1
    watch.arrived(request("new", "c", NOW))
    watch.hold_back([*waiting, request("new", "c", NOW)], running)
    assert built == 2

    metrics = tmp_path / channel.METRICS_FILE
    rendered = channel.mtime(metrics)
    time.sleep(0.02)
    watch.last_seats = None  # a changed record: published
    watch.step_done(output, waiting, running)
    assert channel.mtime(metrics) == rendered  # nobody asked since
    channel.replace_file(tmp_path / channel.WANTED_FILE, b"")
    watch.last_seats = None
    watch.step_done(output, waiting, running)
    assert channel.mtime(metrics) > rendered
