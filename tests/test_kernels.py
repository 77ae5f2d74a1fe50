"""The Triton kernels (engine/kernels) against an fp32 reference and the engine's TorchBackend.

On CPU the small shapes run under the Triton interpreter in a subprocess (TRITON_INTERPRET must be
set before triton is imported, and this process may already hold compiled-mode kernels). The large
shapes need CUDA and are marked `gpu`.
"""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from interpreter import run_under_interpreter  # noqa: E402
from kernel_cases import (CPU_SHAPES, GPU_SHAPES, WINDOW_CASES, WINDOW_GPU_CASES,  # noqa: E402
                          check_decode_padding, check_fp8_cache, check_norm_act, check_qkv_prep, check_shape,
                          check_unequal_decode, check_windowed)

REL_TOL = 1e-2
HAS_TRITON = importlib.util.find_spec("triton") is not None
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")


def assert_results(results: dict) -> None:
    if "skipped" in results:
        pytest.skip(results["skipped"])
    for check, (error, all_written) in results.items():
        assert all_written, f"{check}: some outputs were left unwritten (NaN poison survived)"
        if "store" in check or check.endswith("_identical"):
            assert error == 0, f"{check}: {int(error)} elements differ"
        elif "exact_share" in check:
            assert error < 0.01, f"{check}: {error:.1%} of the elements differ from the eager layers"
        else:
            assert error < REL_TOL, f"{check}: relative error {error:.3g}"


@pytest.fixture(scope="module")
def interpreted() -> dict:
    """All CPU shapes, run once under the interpreter in a fresh interpreter process."""
    return run_under_interpreter(Path(__file__).parent / "kernel_cases.py")


@needs_triton
@pytest.mark.parametrize("shape", [s.name for s in CPU_SHAPES])
def test_kernels_match_reference_under_interpreter(interpreted, shape):
    assert_results(interpreted[shape])


@needs_triton
def test_decode_padding_rows_stay_finite_under_interpreter(interpreted):
    assert_results(interpreted["padding"])


@needs_triton
def test_decode_of_unequal_lengths_matches_reference_under_interpreter(interpreted):
    assert_results(interpreted["unequal"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_decode_of_unequal_lengths_matches_reference_on_gpu():
    assert_results(check_unequal_decode("cuda"))


@needs_triton
def test_triton_backend_matches_torch_backend_under_interpreter(interpreted):
    assert_results(interpreted["backend"])


FP8_CHECKS = ("fp8_prefill", "fp8_mixed_routed", "fp8_decode_default_splits", "fp8_store_kvcache",
              "fp8_qknorm_gqa7_d128_k_exact_share", "fp8_qknorm_gqa7_d128_store_v", "fp8_backend_forward")


@needs_triton
def test_fp8_kv_cache_kernels_match_reference_and_torch_cast_under_interpreter(interpreted):
    results = interpreted["fp8"]
    assert set(FP8_CHECKS) <= set(results), results.get("skipped", sorted(results))
    assert_results(results)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fp8_kv_cache_kernels_match_reference_and_torch_cast_on_gpu():
    results = check_fp8_cache("cuda")
    assert set(FP8_CHECKS) <= set(results), sorted(results)
    assert_results(results)


@needs_triton
def test_sliding_window_and_soft_cap_attention_match_reference_under_interpreter(interpreted):
    results = interpreted["windowed"]
    assert sum(k.endswith("_backend") for k in results) == len(WINDOW_CASES), results.get("skipped", sorted(results))
    assert_results(results)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_sliding_window_and_soft_cap_attention_match_reference_on_gpu():
    results = check_windowed("cuda", cases=WINDOW_GPU_CASES)
    assert sum(k.endswith("_backend") for k in results) == len(WINDOW_GPU_CASES)
    assert_results(results)


@needs_triton
def test_qkv_prep_matches_eager_layers_under_interpreter(interpreted):
    assert_results(interpreted["qkv_prep"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_qkv_prep_matches_eager_layers_on_gpu():
    assert_results(check_qkv_prep("cuda"))


@needs_triton
def test_norm_activation_and_soft_cap_kernels_match_eager_layers_under_interpreter(interpreted):
    assert_results(interpreted["norm_act"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_norm_activation_and_soft_cap_kernels_match_eager_layers_on_gpu():
    assert_results(check_norm_act("cuda"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=lambda s: s.name)
def test_kernels_match_reference_on_gpu(shape):
    assert_results(check_shape(shape, "cuda"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_decode_padding_rows_stay_finite_on_gpu():
    assert_results(check_decode_padding("cuda"))


def test_prefill_only_steps_are_told_apart_from_steps_with_decode_rows():
    """has_decode_rows decides whether a step launches the decode kernels: a one-token row anywhere (a
    decode, or a one-token chunk, which the decode kernels compute) says yes, chunks of 2+ tokens no."""
    from engine.attention import has_decode_rows

    assert not has_decode_rows(torch.tensor([0, 9, 39], dtype=torch.int32))
    assert has_decode_rows(torch.tensor([0, 9, 10, 40], dtype=torch.int32))
    assert has_decode_rows(torch.tensor([0, 1, 2, 3], dtype=torch.int32))
