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
from fused_decode_cases import FP8_CPU_CASES, FP8_GPU_CASES, GPU_CASES, check_fused_decode  # noqa: E402
from interpreter import run_under_interpreter  # noqa: E402
from test_kernels import assert_results  # noqa: E402

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")


@needs_triton
def test_fused_decode_equals_qkv_prep_then_decode_under_interpreter():
    results = run_under_interpreter(Path(__file__).parent / "fused_decode_cases.py")
    assert len(results) == (5 + len(FP8_CPU_CASES)) * 8, sorted(results)
    assert_results(results)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fused_decode_equals_qkv_prep_then_decode_on_gpu():
    assert_results(check_fused_decode(GPU_CASES, "cuda"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fused_decode_with_fp8_cache_equals_qkv_prep_then_decode_on_gpu():
    results = check_fused_decode(FP8_GPU_CASES, "cuda", cache_dtype=torch.float8_e4m3fn)
    assert len(results) == len(FP8_GPU_CASES) * 8
    assert_results(results)
