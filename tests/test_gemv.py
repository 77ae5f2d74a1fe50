"""gemv (engine/kernels/gemv.py) against torch's F.linear, and the launch settings around it.

On CPU the kernel cases run under the Triton interpreter in a subprocess (this file run as a script).
The model-sized shapes, programmatic dependent launch and CUDA-graph replays need CUDA and are marked `gpu`.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from interpreter import run_under_interpreter

triton = pytest.importorskip("triton")
from engine.kernels import gemv as gemv_module  # noqa: E402
from engine.kernels.gemv import MAX_SLICE, MIN_PROGRAMS, gemv, slice_rows  # noqa: E402
from engine.kernels.launch import pdl_options  # noqa: E402
from engine.kernels.norm_act import act_and_mul, rms_norm  # noqa: E402

TOLERANCE = {"float32": 1e-5, "bfloat16": 1e-2, "float16": 1e-2}
# (N, K) of the Qwen3-0.6B and Qwen3-8B projections, and the 8B's at TP=2
MODEL_SHAPES = [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072),
                (6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288),
                (3072, 4096), (4096, 2048), (12288, 4096), (4096, 6144)]


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def check_case(M: int, N: int, K: int, dtype: torch.dtype, bias: bool, device: str, strided: bool = False,
               gated: bool = False, norm: str | None = None, seed: int = 0, dot: bool | None = None,
               act: str = "silu", unit_offset: bool = False) -> dict:
    """gemv against F.linear in float32 on random inputs; gated: against F.linear of act_and_mul(x, act) (the
    engine's own activation, whose roundings the fused prologue must repeat); norm "residual" or "plain":
    against F.linear of the engine's RMSNorm kernel's output (with or without a residual added first; scaled
    by 1 + weight with unit_offset), and the new residual equal to that kernel's. dot: gemv's choice of kernel
    (None: its own)."""
    gen = torch.Generator().manual_seed(seed)
    width = 2 * K if gated else K
    x = torch.randn(M, width + 24, generator=gen)[:, 7:7 + width] if strided else torch.randn(M, width, generator=gen)
    w = torch.randn(N, K, generator=gen) / K ** 0.5
    b = torch.randn(N, generator=gen) if bias else None
    residual = torch.randn(M, K, generator=gen).to(device, dtype) if norm == "residual" else None
    norm_weight = (torch.rand(K, generator=gen) + 0.5).to(device, dtype)
    x, w = x.to(device, dtype), w.to(device, dtype)
    b = b.to(device, dtype) if b is not None else None
    result = {}
    if norm is None:
        out = gemv(x, w, b, gated=gated, dot=dot, act=act)
        x_in = act_and_mul(x, act) if gated else x
    elif residual is None:
        out = gemv(x, w, b, norm=(None, norm_weight, 1e-6), dot=dot, unit_offset=unit_offset)
        x_in = rms_norm(x, norm_weight, 1e-6, unit_offset=unit_offset)
    else:
        out, new_residual = gemv(x, w, b, norm=(residual, norm_weight, 1e-6), dot=dot, unit_offset=unit_offset)
        x_in, want_residual = rms_norm(x, norm_weight, 1e-6, residual=residual, unit_offset=unit_offset)
        result["residual_equal"] = torch.equal(new_residual, want_residual)
    ref = F.linear(x_in.float(), w.float(), b.float() if b is not None else None)
    return {**result, "error": relative_error(out, ref), "dtype": str(dtype).removeprefix("torch."),
            "dtype_ok": out.dtype == dtype, "shape_ok": tuple(out.shape) == (M, N)}


def interpreter_cases() -> dict[str, dict]:
    results = {}
    # N=50: a partial last slice; K=200: a weight row shorter than its power-of-two tile; K=64: exact
    for M in (1, 3, 16):
        for N, K in ((50, 200), (64, 64)):
            for dtype in (torch.float32, torch.bfloat16):
                for bias in (False, True):
                    name = f"M{M}-N{N}-K{K}-{str(dtype).removeprefix('torch.')}-{'bias' if bias else 'nobias'}"
                    results[name] = check_case(M, N, K, dtype, bias, "cpu", seed=M + N + K)
    results["fp16-bias"] = check_case(5, 50, 200, torch.float16, True, "cpu")
    results["strided-x"] = check_case(4, 40, 72, torch.bfloat16, True, "cpu", strided=True)
    for M in (1, 6):
        for dtype in (torch.float32, torch.bfloat16):
            results[f"gated-M{M}-{str(dtype).removeprefix('torch.')}"] = check_case(
                M, 50, 200, dtype, M > 1, "cpu", gated=True, strided=M > 1)
    for M, N, K, norm in ((1, 50, 200, "residual"), (5, 64, 64, "residual"), (3, 40, 72, "plain")):
        for dtype in (torch.float32, torch.bfloat16):
            results[f"norm-{norm}-M{M}-N{N}-K{K}-{str(dtype).removeprefix('torch.')}"] = check_case(
                M, N, K, dtype, M > 1, "cpu", norm=norm, strided=M == 3, seed=M + K)
    # the tensor-core kernel past DOT_ABOVE_ROWS (above, from 3 rows) against the row loop at those rows; K=48
    # and 3072-like splits (32 + 16, 64 + 64 masked to 8) and 20 rows (a 32-row tile)
    for M, N, K in ((3, 50, 200), (16, 64, 64), (20, 40, 48), (7, 33, 72)):
        for dot in (False, True):
            for dtype in (torch.float32, torch.bfloat16):
                results[f"{'dot' if dot else 'rows'}-M{M}-N{N}-K{K}-{str(dtype).removeprefix('torch.')}"] = check_case(
                    M, N, K, dtype, True, "cpu", seed=M * K, dot=dot)
    for norm, gated in (("residual", False), ("plain", False), (None, True)):
        for dtype in (torch.float32, torch.bfloat16):
            results[f"dot-{norm or 'gated'}-M9-N40-K72-{str(dtype).removeprefix('torch.')}"] = check_case(
                9, 40, 72, dtype, True, "cpu", norm=norm, gated=gated, strided=True, seed=9, dot=True)
    # Gemma's: GeGLU (gelu_tanh) gating and the norm scaling by 1 + weight, in the row loop and the dot kernel
    for M, dot in ((1, False), (2, False), (9, True)):
        for dtype in (torch.float32, torch.bfloat16):
            suffix = f"M{M}-{'dot' if dot else 'rows'}-{str(dtype).removeprefix('torch.')}"
            results[f"gelu-gated-{suffix}"] = check_case(M, 50, 72, dtype, False, "cpu", gated=True, seed=M + 1,
                                                         dot=dot, act="gelu_tanh")
            results[f"unit-offset-norm-{suffix}"] = check_case(M, 40, 72, dtype, False, "cpu", norm="residual",
                                                               seed=M + 2, dot=dot, unit_offset=True)
    return results


@pytest.fixture(scope="module")
def interpreted() -> dict:
    return run_under_interpreter(Path(__file__))


def test_gemv_matches_f_linear_under_interpreter(interpreted):
    assert len(interpreted) == 3 * 2 * 2 * 2 + 2 + 4 + 6 + 4 * 2 * 2 + 3 * 2 + 3 * 2 * 2
    for name, result in interpreted.items():
        assert result["dtype_ok"] and result["shape_ok"], f"{name}: wrong output dtype or shape"
        assert result.get("residual_equal", True), f"{name}: the new residual differs from x + residual"
        assert result["error"] < TOLERANCE[result["dtype"]], f"{name}: relative error {result['error']:.3g}"


@pytest.mark.parametrize("N,K", MODEL_SHAPES, ids=str)
def test_slices_fit_the_register_budget_and_fill_the_gpu(N, K):
    rows = slice_rows(N, K)
    assert rows & (rows - 1) == 0 and 1 <= rows <= 32
    assert rows * triton.next_power_of_2(K) <= MAX_SLICE
    assert -(-N // rows) >= MIN_PROGRAMS or rows <= 4


def test_mismatched_inputs_are_rejected_with_the_reason():
    w = torch.zeros(8, 16)
    with pytest.raises(ValueError, match=r"x must be \[M, 16\]"):
        gemv(torch.zeros(2, 15), w)
    with pytest.raises(ValueError, match="one dtype"):
        gemv(torch.zeros(2, 16, dtype=torch.float16), w)
    with pytest.raises(ValueError, match="bias"):
        gemv(torch.zeros(2, 16), w, torch.zeros(7))
    with pytest.raises(ValueError, match=r"x must be \[M, 32\] .*\(gated\)"):
        gemv(torch.zeros(2, 16), w, gated=True)
    with pytest.raises(ValueError, match="either the RMSNorm or the SiLU"):
        gemv(torch.zeros(2, 32), w, gated=True, norm=(None, torch.ones(16), 1e-6))
    with pytest.raises(ValueError, match=r"norm weight must be a contiguous \[16\]"):
        gemv(torch.zeros(2, 16), w, norm=(None, torch.ones(15), 1e-6))
    with pytest.raises(ValueError, match="residual must be"):
        gemv(torch.zeros(2, 16), w, norm=(torch.zeros(3, 16), torch.ones(16), 1e-6))
    with pytest.raises(ValueError, match="block_n must be a power of two"):
        gemv(torch.zeros(2, 16), w, block_n=3)


def test_the_tensor_core_kernel_refuses_a_slice_it_cannot_hold():
    x, w = torch.zeros(4, 4096), torch.zeros(64, 4096)
    with pytest.raises(ValueError, match=r"power-of-two block_n whose \[block_n, 4096\] slice has at most 24576"):
        gemv(x, w, dot=True)
    with pytest.raises(ValueError, match="got block_n 12"):
        gemv(torch.zeros(4, 64), torch.zeros(64, 64), block_n=12, dot=True)


def test_gemv_is_never_taken_for_cpu_tensors():
    x, w = torch.zeros(1, 16, dtype=torch.bfloat16), torch.zeros(8, 16, dtype=torch.bfloat16)
    assert not gemv_module.takes(x, w)


def test_first_layer_norm_before_its_projection_takes_no_residual():
    """RMSNorm.linear without a residual (the first decoder layer, where the GEMV fuses the norm alone):
    the projection of the norm of x, and x itself as the residual the layer carries on."""
    from engine.layers.linear import ReplicatedLinear
    from engine.layers.norm import RMSNorm

    gen = torch.Generator().manual_seed(0)
    norm, proj = RMSNorm(16), ReplicatedLinear(16, 8)
    norm.weight.data = torch.rand(16, generator=gen) + 0.5
    proj.weight.data = torch.randn(8, 16, generator=gen)
    x = torch.randn(3, 16, generator=gen)
    out, residual = norm.linear(x, None, proj)
    assert residual is x
    torch.testing.assert_close(out, proj(norm(x)))
    with_zero, _ = norm.linear(x, torch.zeros_like(x), proj)
    torch.testing.assert_close(with_zero, out)


def test_gemv_refuses_more_rows_than_it_unrolls():
    x, w = torch.zeros(33, 16, dtype=torch.bfloat16), torch.zeros(8, 16, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="gemv takes at most 32 rows of x, got 33; use F.linear"):
        gemv_module.gemv(x, w)


def test_pdl_is_never_asked_for_off_the_gpu():
    assert pdl_options(torch.zeros(1)) == {"PDL": False}


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("N,K", MODEL_SHAPES, ids=str)
def test_gemv_matches_f_linear_on_model_shapes_on_gpu(N, K):
    w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) / K ** 0.5
    b = torch.randn(N, device="cuda", dtype=torch.bfloat16)
    for M in (1, 2, 5, 8, 16):
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        out = gemv(x, w, b)
        assert torch.isfinite(out).all(), f"[{N}, {K}] M={M}: output not all written"
        error = relative_error(out, F.linear(x.float(), w.float(), b.float()))
        assert error < 1e-2, f"[{N}, {K}] M={M}: relative error {error:.3g}"
        gate_up = torch.randn(M, 2 * K, device="cuda", dtype=torch.bfloat16)
        fused = gemv(gate_up, w, gated=True)
        error = relative_error(fused, F.linear(act_and_mul(gate_up).float(), w.float()))
        assert error < 1e-2, f"[{N}, {K}] M={M} gated: relative error {error:.3g}"
        residual = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        norm_weight = torch.rand(K, device="cuda", dtype=torch.bfloat16) + 0.5
        normed, new_residual = gemv(x, w, b, norm=(residual, norm_weight, 1e-6))
        want, want_residual = rms_norm(x, norm_weight, 1e-6, residual=residual)
        assert torch.equal(new_residual, want_residual), f"[{N}, {K}] M={M}: new residual"
        error = relative_error(normed, F.linear(want.float(), w.float(), b.float()))
        assert error < 1e-2, f"[{N}, {K}] M={M} norm: relative error {error:.3g}"
        if M > gemv_module.DOT_ABOVE_ROWS and gemv_module.dot_fits(K):  # the tensor cores against the row loop
            error = relative_error(gemv(x, w, b, dot=True), gemv(x, w, b, dot=False).float())
            assert error < 1e-2, f"[{N}, {K}] M={M}: the two kernels differ by {error:.3g}"


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("rows", [1, 3], ids=["next_kernel_after_the_weight_loads", "next_kernel_first_thing"])
def test_a_chain_of_pdl_kernels_replays_in_a_cuda_graph_in_stream_order(rows):
    """Each kernel reads what the one before it wrote; with PDL the next one starts early, so a missing wait
    would read stale rows. A graph of GEMVs and norms, replayed with new inputs, must equal the eager chain
    launched without PDL (with one row the GEMV lets the next kernel start later than with more)."""
    from engine.kernels import launch
    from engine.kernels.norm_act import rms_norm

    assert pdl_options(torch.zeros(1, device="cuda")).get("PDL") == (torch.cuda.get_device_capability()[0] >= 9)
    gen = torch.Generator(device="cuda").manual_seed(0)
    weights = [(torch.randn(4096, 1024, device="cuda", generator=gen, dtype=torch.bfloat16) / 32,
                torch.randn(1024, 4096, device="cuda", generator=gen, dtype=torch.bfloat16) / 64,
                torch.rand(1024, device="cuda", generator=gen, dtype=torch.bfloat16) + 0.5) for _ in range(6)]
    x = torch.randn(rows, 1024, device="cuda", dtype=torch.bfloat16)

    def chain(h):
        for up, down, norm in weights:
            h = rms_norm(gemv(gemv(h, up), down), norm, 1e-6)
        return h

    chain(x)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chain(x)
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        graph.replay()
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(launch, "device_has_pdl", lambda index: False)
            ref = chain(x.clone())
        assert torch.equal(out, ref)


if __name__ == "__main__":
    print(json.dumps(interpreter_cases()))
