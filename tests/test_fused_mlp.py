"""The fused MLP kernel (engine/kernels/mlp.py) against the unfused chain, and the gemv that reads its sums.

On CPU the kernel cases run under the Triton interpreter in a subprocess (this file run as a script). The
model's shape, the order-independence of the sums across many launches, and the engine with and without the
fused MLP need CUDA and are marked `gpu`.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from interpreter import run_under_interpreter

triton = pytest.importorskip("triton")
from engine.kernels import mlp as mlp_module  # noqa: E402
from engine.kernels.gemv import gemv  # noqa: E402
from engine.kernels.mlp import FIXED_SCALE, from_fixed, fused_mlp  # noqa: E402
from engine.kernels.norm_act import rms_norm, silu_and_mul  # noqa: E402
from engine.layers import fusion  # noqa: E402

TOLERANCE = {"float32": 1e-5, "bfloat16": 1e-2, "float16": 1e-2}


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def mlp_inputs(M: int, H: int, I: int, dtype: torch.dtype, device: str, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(M, H, generator=gen)
    residual = torch.randn(M, H, generator=gen)
    norm_weight = torch.rand(H, generator=gen) + 0.5
    gate_up = torch.randn(2 * I, H, generator=gen) / H ** 0.5
    down = torch.randn(H, I, generator=gen) / I ** 0.5
    return [t.to(device, dtype) for t in (x, residual, norm_weight, gate_up, down)]


def unfused(x, residual, norm_weight, gate_up, down):
    """The engine's unfused chain in float32 products: RMSNorm kernel, gate_up, SiLU·mul kernel, down."""
    normed, new_residual = rms_norm(x, norm_weight, 1e-6, residual=residual)
    h = F.linear(normed.float(), gate_up.float()).to(x.dtype)
    return F.linear(silu_and_mul(h).float(), down.float()), new_residual


def check_case(M: int, H: int, I: int, dtype: torch.dtype, device: str, seed: int = 0,
               width: int | None = None) -> dict:
    x, residual, norm_weight, gate_up, down = mlp_inputs(M, H, I, dtype, device, seed)
    sums = torch.zeros(M, H, dtype=torch.int64, device=device)
    new_residual = fused_mlp(x, residual, norm_weight, 1e-6, gate_up, down, sums, width=width)
    ref, want_residual = unfused(x, residual, norm_weight, gate_up, down)
    out = from_fixed(sums, dtype)
    # launched again onto the same sums, the sum doubles exactly: the kernel adds, and integers add exactly
    fused_mlp(x, residual, norm_weight, 1e-6, gate_up, down, sums, width=width)
    doubled = torch.equal(sums % 2, torch.zeros_like(sums))
    # the next layer's qkv GEMV reading the sums directly equals it reading them converted
    w = torch.randn(48, H, generator=torch.Generator().manual_seed(seed + 1)).to(device, dtype) / H ** 0.5
    half = sums // 2
    read, read_residual = gemv(half, w, norm=(residual, norm_weight, 1e-6), x_fixed=True)
    want_read, want_read_residual = gemv(from_fixed(half, dtype), w, norm=(residual, norm_weight, 1e-6))
    return {"error": relative_error(out, ref), "dtype": str(dtype).removeprefix("torch."),
            "residual_equal": torch.equal(new_residual, want_residual), "doubled": doubled,
            "read_equal": torch.equal(read, want_read) and torch.equal(read_residual, want_read_residual),
            "shape_ok": tuple(out.shape) == (M, H) and new_residual.dtype == dtype}


def interpreter_cases() -> dict[str, dict]:
    results = {}
    # H=64: a power of two; H=200: a row shorter than its tile; I=100: a partial last column slice
    for M in (1, 2):
        for H, I in ((64, 96), (200, 100)):
            for dtype in (torch.float32, torch.bfloat16):
                name = f"M{M}-H{H}-I{I}-{str(dtype).removeprefix('torch.')}"
                results[name] = check_case(M, H, I, dtype, "cpu", seed=M + H + I)
    results["fp16"] = check_case(1, 64, 96, torch.float16, "cpu")
    results["width-4"] = check_case(2, 64, 96, torch.bfloat16, "cpu", width=4)
    return results


@pytest.fixture(scope="module")
def interpreted() -> dict:
    return run_under_interpreter(Path(__file__))


def test_fused_mlp_matches_the_unfused_chain_under_interpreter(interpreted):
    assert len(interpreted) == 2 * 2 * 2 + 2
    for name, result in interpreted.items():
        assert result["shape_ok"], f"{name}: wrong output shape or dtype"
        assert result["residual_equal"], f"{name}: the new residual differs from the RMSNorm kernel's"
        assert result["error"] < TOLERANCE[result["dtype"]], f"{name}: relative error {result['error']:.3g}"
        assert result["doubled"], f"{name}: a second launch did not add the same sums again"
        assert result["read_equal"], f"{name}: gemv reads the fixed-point sums unlike their conversion"


def test_fixed_point_conversion_rounds_to_the_model_dtype():
    values = torch.tensor([[1.0, -2.5, 2.0 ** -20, 1234.5678, -0.1, 3.0 ** 0.5]], dtype=torch.float64)
    sums = torch.round(values * FIXED_SCALE).to(torch.int64)
    assert torch.equal(from_fixed(sums, torch.bfloat16), values.to(torch.bfloat16))


def test_model_shapes_that_fit_the_fused_mlp():
    assert mlp_module.block_i(1024, 3072) == 8            # Qwen3-0.6B: 384 programs of 24K elements
    assert mlp_module.fits(64, 96)                        # the test models
    assert not mlp_module.fits(4096, 12288)               # Qwen3-8B: its slices would not fit registers


def test_mismatched_inputs_are_rejected_with_the_reason():
    x, residual, norm_weight, gate_up, down = mlp_inputs(1, 64, 96, torch.float32, "cpu")
    sums = torch.zeros(1, 64, dtype=torch.int64)
    with pytest.raises(ValueError, match="1 to 2 rows, got 3"):
        fused_mlp(torch.zeros(3, 64), torch.zeros(3, 64), norm_weight, 1e-6, gate_up, down, sums)
    with pytest.raises(ValueError, match=r"gate_up must be \[2I, H\] = \[192, 64\]"):
        fused_mlp(x, residual, norm_weight, 1e-6, gate_up[:100], down, sums)
    with pytest.raises(ValueError, match="one dtype"):
        fused_mlp(x.half(), residual, norm_weight, 1e-6, gate_up, down, sums)
    with pytest.raises(ValueError, match=r"norm weight must be a contiguous \[64\]"):
        fused_mlp(x, residual, norm_weight[:10], 1e-6, gate_up, down, sums)
    with pytest.raises(ValueError, match=r"sums must be int64 \[1, 64\]"):
        fused_mlp(x, residual, norm_weight, 1e-6, gate_up, down, sums.float())
    with pytest.raises(ValueError, match="x_fixed takes int64 sums of at most 2 rows"):
        gemv(torch.zeros(3, 64, dtype=torch.int64), torch.zeros(8, 64), x_fixed=True)


@pytest.mark.parametrize("value", ["3", "yes"])
def test_bad_fused_mlp_rows_setting_is_a_clear_error(monkeypatch, value):
    monkeypatch.setenv("REDLINE_FUSED_MLP_ROWS", value)
    fusion.fused_mlp_rows.cache_clear()
    try:
        with pytest.raises(ValueError, match=f"REDLINE_FUSED_MLP_ROWS must be 0, 1 or 2, got '{value}'"):
            fusion.fused_mlp_rows()
    finally:
        fusion.fused_mlp_rows.cache_clear()


def test_the_fused_mlp_is_never_taken_for_cpu_tensors():
    x, _, _, gate_up, down = mlp_inputs(1, 64, 96, torch.bfloat16, "cpu")
    assert not fusion.takes_fused_mlp(x, gate_up, down)


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("M", [1, 2])
def test_fused_mlp_matches_the_unfused_chain_on_the_model_shape_on_gpu(M):
    """Qwen3-0.6B's MLP: within bf16 of the unfused chain, the new residual exact, and the sums identical
    over repeated launches (integer atomics: the programs' order does not show)."""
    x, residual, norm_weight, gate_up, down = mlp_inputs(M, 1024, 3072, torch.bfloat16, "cuda")
    ref, want_residual = unfused(x, residual, norm_weight, gate_up, down)
    first = None
    for _ in range(20):
        sums = torch.zeros(M, 1024, dtype=torch.int64, device="cuda")
        new_residual = fused_mlp(x, residual, norm_weight, 1e-6, gate_up, down, sums)
        if first is None:
            first = sums
            assert torch.equal(new_residual, want_residual)
            error = relative_error(from_fixed(sums, torch.bfloat16), ref)
            assert error < 1e-2, f"relative error {error:.3g}"
        assert torch.equal(sums, first), "the sums changed between launches"


if __name__ == "__main__":
    print(json.dumps(interpreter_cases()))
