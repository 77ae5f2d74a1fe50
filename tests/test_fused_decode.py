"""Decode attention from the qkv rows in one kernel (engine/kernels/fused_decode.py): the same output
and cache writes as qkv_prep followed by paged_decode, the partials merged by the last program of each
KV head. Under the Triton interpreter on CPU (a subprocess), and at the engine's sizes on CUDA."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from fused_decode_cases import (FP8_CPU_CASES, FP8_GPU_CASES, GPU_CASES, WINDOW_CPU_CASES,  # noqa: E402
                                WINDOW_GPU_CASES, check_fused_decode, decode_problem)
from interpreter import run_under_interpreter  # noqa: E402
from test_kernels import assert_results  # noqa: E402

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")


@needs_triton
def test_fused_decode_equals_qkv_prep_then_decode_under_interpreter():
    results = run_under_interpreter(Path(__file__).parent / "fused_decode_cases.py")
    assert len(results) == (7 + len(WINDOW_CPU_CASES) + len(FP8_CPU_CASES)) * 8 + 2 * 2, sorted(results)
    assert_results(results)


@needs_triton
def test_loop_stages_take_one_after_the_gemv_by_default_and_each_setting_where_it_applies():
    from engine.kernels.fused_decode import loop_stages
    from engine.kernels.paged_decode import DecodeConfig, default_decode_config

    default = DecodeConfig()
    assert loop_stages(default, early=True) == 1                   # after the GEMV: one or two rows
    assert loop_stages(default, early=False) == 3                  # after cuBLAS
    swept = DecodeConfig(num_stages=4, stages_after_gemv=2)
    assert (loop_stages(swept, early=True), loop_stages(swept, early=False)) == (2, 4)
    cpu = default_decode_config(torch.zeros(1))
    assert (loop_stages(cpu, early=True), loop_stages(cpu, early=False)) == (1, 1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fused_decode_equals_qkv_prep_then_decode_on_gpu():
    assert_results(check_fused_decode(GPU_CASES, "cuda"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fused_decode_with_sliding_window_and_soft_cap_equals_qkv_prep_then_decode_on_gpu():
    results = check_fused_decode(WINDOW_GPU_CASES, "cuda")
    assert len(results) == len(WINDOW_GPU_CASES) * 8
    assert_results(results)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fused_decode_with_fp8_cache_equals_qkv_prep_then_decode_on_gpu():
    results = check_fused_decode(FP8_GPU_CASES, "cuda", cache_dtype=torch.float8_e4m3fn)
    assert len(results) == len(FP8_GPU_CASES) * 8
    assert_results(results)


@needs_triton
def test_first_page_is_read_early_for_one_sequence_after_the_gemv_only():
    from engine.kernels.fused_decode import early_page_applies
    from engine.kernels.paged_decode import DecodeConfig

    config, cache = DecodeConfig(block_n=64), torch.zeros(4, 256, 1, 16)
    assert early_page_applies(True, 1, cache, config)
    assert not early_page_applies(True, 2, cache, config)          # two rows measured slower
    assert not early_page_applies(False, 1, cache, config)         # after cuBLAS: nothing read early
    assert not early_page_applies(True, 1, torch.zeros(4, 32, 1, 16), config)  # a tile spans pages


@needs_triton
def test_first_tile_prefetch_is_never_taken_off_the_gpu():
    from engine.kernels.fused_decode import prefetch_applies

    assert not prefetch_applies(torch.zeros(1))  # the interpreter has no prefetch instruction


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("lens", [[700], [64], [1]], ids=["ragged", "one_tile", "one_position"])
def test_first_tile_prefetch_leaves_one_sequence_decode_unchanged(monkeypatch, lens):
    """The first K/V tile queued into L2 before the wait (one sequence after the GEMV, on the GPU): the output
    and both caches equal those without it, for ranges that end inside a tile, fill one tile exactly, or hold
    one position (most programs' ranges empty)."""
    from engine.kernels import fused_decode as kernel
    from engine.kernels.fused_decode import fused_decode

    heads, kv_heads, splits = 16, 8, 32
    qkv, positions, slots, seqlens, tables, caches, cos, sin, (qw, kw) = decode_problem(
        heads, kv_heads, 128, 256, lens, True, 0, torch.bfloat16, "cuda", 5)
    results = []
    assert kernel.prefetch_applies(qkv)
    for prefetch in (False, True):
        monkeypatch.setattr(kernel, "prefetch_applies", lambda qkv, on=prefetch: on)
        k_cache, v_cache = (c.clone() for c in caches)
        counters = torch.zeros(kv_heads, dtype=torch.int32, device="cuda")
        out = fused_decode(qkv, positions, cos, sin, qw, kw, 1e-6, k_cache, v_cache, slots, seqlens, tables,
                           max(lens), 128 ** -0.5, heads, kv_heads, counters, num_splits=splits, after_gemv=True)
        torch.cuda.synchronize()
        results.append((out, k_cache, v_cache, counters))
    for without, with_prefetch in zip(results[0], results[1]):
        assert torch.equal(without, with_prefetch)


@needs_triton
def test_the_merge_loads_all_heads_of_a_kv_head_at_once_while_the_tile_fits():
    from engine.kernels.fused_decode import MERGE_VALUES, merge_heads

    assert merge_heads(2, 32, 128) == 2                  # Qwen3-0.6B at batch 1: both heads, one round trip
    assert merge_heads(4, 32, 128) == 2                  # Qwen3-8B: two rounds of two
    assert merge_heads(7, 4, 64) == 8                    # a group not a power of two: masked to 7
    assert merge_heads(1, 64, 128) == 1
    assert merge_heads(8, 16, 128) == 4 and 4 * 16 * 128 <= MERGE_VALUES
    assert merge_heads(16, 64, 256) == 1                 # never fewer than one head
