"""The compiled LoRA kernel: the loop's arithmetic in one call per projection, read from the
pool's pages; and the threads around the step loop kept from slowing it down."""

from __future__ import annotations

import os
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils import cpp_extension
from torch.utils._cpp_extension_versioner import ExtensionVersioner

from lora_guard import LLM, SamplingParams
from lora_guard.demo.testing import AdapterFactory
from lora_guard.engine import native
from lora_guard.engine.lora import kernel
from lora_guard.engine.lora.compute import LoraBatch, LoraSegment, kernel_plan, resolve_mode
from lora_guard.engine.lora.pool import ModulePart, ProjectionWeights
from lora_guard.engine.threads import openmp_libraries, serial_thread, serially


def why_no_kernel() -> str | None:
    """Why the kernel cannot be built here (None when it can): the compiler torch's extension
    builder would call (``$CXX``, else ``c++``) or ninja is missing."""
    compiler = cpp_extension.get_cxx_compiler()
    if shutil.which(compiler) is None:
        return f"no C++ compiler: {compiler!r} ($CXX, else c++) not found; the engine uses the loop"
    if not cpp_extension.is_ninja_available():
        return "no ninja: torch cannot build the kernel; the engine uses the loop"
    return None


NO_KERNEL = why_no_kernel()
needs_kernel = pytest.mark.skipif(NO_KERNEL is not None, reason=NO_KERNEL or "")


@pytest.fixture(scope="module")
def adapters(tiny_adapters: AdapterFactory) -> dict[str, Path]:
    return tiny_adapters(n=6, prefix="k", ranks=(2, 4, 8))


@needs_kernel
def test_the_kernel_builds_and_loads_here() -> None:
    assert native.load(), native.error()  # a C++ compiler and ninja are part of the set-up


@needs_kernel
def test_the_kernel_runs_on_torchs_own_openmp_runtime() -> None:
    assert native.load(), native.error()
    # A second runtime would bring a second team of threads, and the steps would slow down.
    assert len(openmp_libraries()) == 1, openmp_libraries()


FAN_IN = 20  # not a multiple of the kernel's 16 lanes: its tail loop runs too


def pool_segments(pool: torch.Tensor, *, prefill: bool = False) -> list[LoraSegment]:
    """Three adapters' qkv weights as views into ``pool``, over tokens 1-4, 4-5 and 7-11; with
    ``prefill``, a fourth over tokens 12-32 (longer than the kernel's streamed segments)."""
    used = 0

    def view(rows: int, cols: int) -> torch.Tensor:
        nonlocal used
        out = pool[used : used + rows * cols].view(rows, cols)
        used += rows * cols
        return out

    def layers(rank_q: int, rank_v: int) -> list[dict[str, ProjectionWeights]]:
        a = view(rank_q + rank_v, FAN_IN)
        parts = (
            ModulePart(0, rank_q, 0, 16, view(rank_q, 16)),
            ModulePart(rank_q, rank_q + rank_v, 24, 32, view(rank_v, 8)),
        )
        return [{"qkv": ProjectionWeights(a, parts)}]

    spans = [(1, 4, layers(4, 2)), (4, 5, layers(8, 8)), (7, 11, layers(2, 1))]
    if prefill:
        spans.append((12, 32, layers(4, 4)))
    return [LoraSegment(start, end, weights, kernel_plan(weights)) for start, end, weights in spans]


# Pages of float32, or of bfloat16 (half the bytes a step reads): the kernel widens each weight
# exactly and sums in float32, so it computes what the loop does on the pool's float32 values.
# ``pool.float()`` keeps every element where it was: the same plan reads both.
DTYPES = pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16], ids=lambda dtype: str(dtype).removeprefix("torch.")
)


@needs_kernel
@DTYPES
def test_the_kernel_computes_what_the_loop_does(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    pool = torch.randn(4096).to(dtype)
    segments = pool_segments(pool.float(), prefill=True)  # the loop's views, in float32
    x, base = torch.randn(32, FAN_IN), torch.randn(32, 32)
    looped, fused = base.clone(), base.clone()
    LoraBatch(segments, "loop").apply(x, looped, 0, "qkv")
    LoraBatch(segments, "kernel", pool).apply(x, fused, 0, "qkv")
    assert torch.allclose(looped, fused, atol=1e-5)
    assert torch.equal(fused[[0, 5, 6, 11]], base[[0, 5, 6, 11]])  # tokens of no adapter untouched
    assert torch.equal(fused[1:5, 16:24], base[1:5, 16:24])  # k has no weights: untouched
    assert not torch.equal(fused[1:5], base[1:5])
    before = fused.clone()
    LoraBatch(segments, "kernel", pool).apply(x, fused, 0, "o")  # no weights for o at all
    assert torch.equal(fused, before)


@needs_kernel
@DTYPES
def test_in_a_bfloat16_model_the_kernel_adds_the_float32_update_rounded_once(
    dtype: torch.dtype,
) -> None:
    # bfloat16 activations: each segment's rows widened exactly, the update summed in float32 and
    # rounded to bfloat16 once where it is added, so y is what rounding the float32 sum gives.
    torch.manual_seed(2)
    pool = torch.randn(4096).to(dtype)
    segments = pool_segments(pool.float(), prefill=True)
    x, base = torch.randn(32, FAN_IN).bfloat16(), torch.randn(32, 32).bfloat16()
    update = torch.zeros(32, 32)
    LoraBatch(segments, "loop").apply(x.float(), update, 0, "qkv")
    y = base.clone()
    LoraBatch(segments, "kernel", pool).apply(x, y, 0, "qkv")
    assert torch.equal(y, (base.float() + update).bfloat16())
    assert torch.equal(y[[0, 5, 6, 11]], base[[0, 5, 6, 11]])  # tokens of no adapter untouched
    assert not torch.equal(y[1:5], base[1:5])


@needs_kernel
@DTYPES
def test_large_adapters_split_between_threads_compute_what_the_loop_does(
    dtype: torch.dtype,
) -> None:
    # Big enough that the kernel cuts each A by rows and each B by columns across its threads;
    # ranks and widths that are no multiple of four or sixteen, a decode and a prefill segment.
    torch.manual_seed(1)
    fan_in, widths, used = 600, (200, 90, 90), 0
    pool = torch.randn(2_000_000).to(dtype)
    values = pool.float()  # the loop's views, in float32

    def view(rows: int, cols: int) -> torch.Tensor:
        nonlocal used
        out = values[used : used + rows * cols].view(rows, cols)
        used += rows * cols
        return out

    def layers(rank: int) -> list[dict[str, ProjectionWeights]]:
        a, parts, out0 = view(3 * rank, fan_in), [], 0
        for i, width in enumerate(widths):
            parts.append(
                ModulePart(i * rank, (i + 1) * rank, out0, out0 + width, view(rank, width))
            )
            out0 += width
        return [{"qkv": ProjectionWeights(a, tuple(parts))}]

    spans = [(0, 1, layers(62)), (1, 3, layers(33)), (3, 27, layers(17))]
    segments = [LoraSegment(a, b, w, kernel_plan(w)) for a, b, w in spans]
    x, base = torch.randn(27, fan_in), torch.randn(27, sum(widths))
    looped, fused = base.clone(), base.clone()
    LoraBatch(segments, "loop").apply(x, looped, 0, "qkv")
    LoraBatch(segments, "kernel", pool).apply(x, fused, 0, "qkv")
    assert torch.allclose(looped, fused, atol=1e-3, rtol=1e-4)
    assert not torch.allclose(fused, base)


@needs_kernel
def test_a_plan_that_points_outside_the_pool_is_refused_before_any_write() -> None:
    pool = torch.randn(4096)
    segments = pool_segments(pool)
    x, y = torch.randn(11, FAN_IN), torch.zeros(11, 32)
    plan = LoraBatch(segments, "kernel", pool)._plan[0, 0].clone()
    cases = {
        "A outside the pool": (1, 2, 4090),
        "segment outside the batch": (2, 1, 12),
        "part columns outside y": (1, 4 + 5 + 3, 40),
    }
    for message, (row, column, value) in cases.items():
        bad = plan.clone()
        bad[row, column] = value
        with pytest.raises(RuntimeError, match=message):
            kernel.lora_apply(x, y, pool, bad)
        assert not y.any(), message
    with pytest.raises(RuntimeError, match="float32"):
        kernel.lora_apply(x.double(), y.double(), pool.double(), plan)
    with pytest.raises(RuntimeError, match="float32"):  # float32 or bfloat16 pages only
        kernel.lora_apply(x, y, pool.half(), plan)
    with pytest.raises(RuntimeError, match="both float32 or both bfloat16"):
        kernel.lora_apply(x.bfloat16(), y, pool, plan)
    assert not y.any()


@needs_kernel
def test_the_engine_with_the_kernel_matches_the_loop_token_for_token(
    tiny_model: Path, adapters: dict[str, Path]
) -> None:
    names = sorted(adapters)
    prompts = [[5, 6, 7, 8, 9 + i] for i in range(12)]
    ids = [None if i % 5 == 0 else names[i % len(names)] for i in range(12)]
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    outs = {}
    for mode in ("kernel", "loop"):
        llm = LLM(
            tiny_model,
            adapters=adapters,
            cache_memory="4MiB",
            max_loras=3,
            lora_compute=mode,
        )
        assert llm.engine.runner.lora_mode == mode
        outs[mode] = [o.token_ids for o in llm.generate(prompts, params, ids)]
        llm.engine.check_no_leaks()
        llm.engine.shutdown()
    assert outs["kernel"] == outs["loop"]  # three seats, six adapters: they rotate and move


@needs_kernel
def test_auto_takes_the_kernel_in_float32_and_in_bfloat16(
    tiny_model: Path, adapters: dict[str, Path]
) -> None:
    assert LLM(tiny_model, cache_memory="4MiB").engine.runner.lora_mode == "kernel"
    # In bfloat16 its rounding differs from the loop's (which rounds each matmul to bfloat16),
    # so the tokens may differ on a random model: the update itself is checked exactly above.
    bf16 = LLM(tiny_model, adapters=adapters, cache_memory="4MiB", max_loras=3, dtype="bfloat16")
    assert bf16.engine.runner.lora_mode == "kernel"
    names = sorted(adapters)
    outs = bf16.generate(
        [[5, 6, 7, 8]] * 7, SamplingParams(max_new_tokens=6, ignore_eos=True), [None, *names]
    )
    assert all(len(o.token_ids) == 6 for o in outs)
    bf16.engine.check_no_leaks()
    bf16.engine.shutdown()
    assert resolve_mode("auto", torch.float16, torch.device("cpu")) == "loop"
    with pytest.raises(ValueError, match="float32 or bfloat16 model"):
        resolve_mode("kernel", torch.float16, torch.device("cpu"))


def test_without_a_compiler_auto_falls_back_to_the_loop_with_the_same_update(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A build from scratch with a compiler that does not exist: a fresh extension folder, and
    # neither the kernel's nor torch's record of this process's builds.
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-c++"))
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "extensions"))
    monkeypatch.setattr(native, "_state", {})
    monkeypatch.setattr(cpp_extension, "JIT_EXTENSION_VERSIONER", ExtensionVersioner())
    assert resolve_mode("auto", torch.float32, torch.device("cpu")) == "loop"
    assert not native.load() and native.error(), native.error()
    llm = LLM(tiny_model, cache_memory="4MiB")
    assert llm.engine.runner.lora_mode == "loop"
    assert not llm.engine.model.fused  # the layers in torch's operations too
    assert not llm.engine.model.rows  # nor the row kernel
    llm.engine.shutdown()

    torch.manual_seed(0)
    segments = pool_segments(torch.randn(4096), prefill=True)
    x, base = torch.randn(32, FAN_IN), torch.randn(32, 32)
    looped, expected = base.clone(), base.clone()
    LoraBatch(segments, "loop").apply(x, looped, 0, "qkv")
    for seg in segments:  # y += (x @ A.T) @ B, sub-module by sub-module
        weights = seg.layers[0]["qkv"]
        shrunk = x[seg.start : seg.end] @ weights.a.T
        for part in weights.parts:
            update = shrunk[:, part.row0 : part.row1] @ part.bt
            expected[seg.start : seg.end, part.out0 : part.out1] += update
    assert torch.allclose(looped, expected, atol=1e-5)
    assert not torch.equal(looped, base)


def test_threads_beside_the_step_loop_run_torch_serially(
    tiny_model: Path, adapters: dict[str, Path]
) -> None:
    before = torch.get_num_threads()
    llm = LLM(tiny_model, adapters=adapters, cache_memory="4MiB")
    llm.generate([[5, 6, 7]], SamplingParams(max_new_tokens=2), sorted(adapters)[0])
    loader: Any = llm.engine.adapters.loader._pool
    assert loader.submit(torch.get_num_threads).result() == 1
    assert torch.get_num_threads() == before  # the stepping thread keeps its threads
    seen: list[int] = []
    helper = threading.Thread(target=lambda: seen.append(serially(torch.get_num_threads)))
    helper.start()
    helper.join()
    assert seen == [1] and torch.get_num_threads() == before
    llm.engine.shutdown()


def test_serial_thread_leaves_other_threads_their_threads() -> None:
    if torch.get_num_threads() < 2:
        pytest.skip("one core: every thread is serial already")
    seen: list[tuple[int, int]] = []

    def serial_then_ask() -> None:
        first = torch.get_num_threads()
        serial_thread()
        seen.append((first, torch.get_num_threads()))

    helper = threading.Thread(target=serial_then_ask)
    helper.start()
    helper.join()
    assert seen == [(torch.get_num_threads(), 1)]
    fresh: list[int] = []
    other = threading.Thread(target=lambda: fresh.append(torch.get_num_threads()))
    other.start()
    other.join()
    assert fresh == [torch.get_num_threads()]  # a thread made later still gets them all


def test_a_lock_left_by_a_killed_build_is_removed_and_a_live_one_kept(tmp_path: Path) -> None:
    lock = tmp_path / "lock"
    lock.touch()
    native._clear_stale_lock(tmp_path)
    assert lock.exists()  # a build under way: wait for it
    old = time.time() - native.STALE_LOCK_S - 1
    os.utime(lock, (old, old))
    native._clear_stale_lock(tmp_path)
    assert not lock.exists()  # no build runs that long: torch would wait for it forever
    native._clear_stale_lock(tmp_path)  # and none at all is fine
