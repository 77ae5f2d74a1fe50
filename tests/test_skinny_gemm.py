"""skinny_linear (engine/kernels/skinny_gemm.py) against torch's F.linear in fp32.

On CPU the kernel cases run under the Triton interpreter in a subprocess (this file run as a script:
TRITON_INTERPRET must be set before triton is imported, and this process may already hold
compiled-mode kernels). The model-sized shapes and the CUDA-graph replay need CUDA and are marked `gpu`.
"""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from interpreter import run_under_interpreter

pytest.importorskip("triton")
from engine.kernels.skinny_gemm import (SkinnyConfig, block_m_for, choose_config,  # noqa: E402
                                        skinny_linear)

TOLERANCE = {"float32": 1e-5, "bfloat16": 1e-2, "float16": 1e-2}
H100_SMS = 132
# (model, layer, N, K) of Qwen3-0.6B, Qwen3-8B and its TP=2 shards
MODEL_SHAPES = [
    ("0.6B", "qkv", 4096, 1024), ("0.6B", "o", 1024, 2048), ("0.6B", "gate_up", 6144, 1024),
    ("0.6B", "down", 1024, 3072), ("0.6B", "lm_head", 151936, 1024),
    ("8B", "qkv", 6144, 4096), ("8B", "o", 4096, 4096), ("8B", "gate_up", 24576, 4096),
    ("8B", "down", 4096, 12288), ("8B-tp2", "qkv", 3072, 4096), ("8B-tp2", "o", 4096, 2048),
    ("8B-tp2", "gate_up", 12288, 4096), ("8B-tp2", "down", 4096, 6144),
]

# Small configs so N=50, K=200 leave partial tiles on both axes and split-K has several splits.
CPU_CONFIGS = {
    "reduce": SkinnyConfig(block_n=16, block_k=32),
    "reduce_split3": SkinnyConfig(block_n=16, block_k=32, split_k=3),
    "dot_swapped": SkinnyConfig(block_n=32, block_k=32, use_dot=True, swap_ab=True),
    "dot_swapped_split2": SkinnyConfig(block_n=32, block_k=32, split_k=2, use_dot=True, swap_ab=True),
    "dot_split4": SkinnyConfig(block_n=16, block_k=32, split_k=4, use_dot=True, swap_ab=False),
}


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def check_case(M: int, N: int, K: int, dtype: torch.dtype, config: SkinnyConfig | None, bias: bool,
               device: str, x_layout: str = "contiguous", seed: int = 0) -> dict:
    """skinny_linear vs fp32 F.linear on random inputs; returns the error and whether dtype/shape held."""
    gen = torch.Generator().manual_seed(seed)
    if x_layout == "strided":  # rows of a wider buffer: stride(0) != K
        x = torch.randn(M, K + 24, generator=gen)[:, 5:5 + K]
    elif x_layout == "batched":  # leading dims [2, M, K]
        x = torch.randn(2, M, K, generator=gen)
    else:
        x = torch.randn(M, K, generator=gen)
    w = torch.randn(N, K, generator=gen) / K ** 0.5
    b = torch.randn(N, generator=gen) if bias else None
    x, w = x.to(device, dtype), w.to(device, dtype)
    b = b.to(device, dtype) if b is not None else None
    out = skinny_linear(x, w, b, config=config)
    ref = F.linear(x.float(), w.float(), b.float() if b is not None else None)
    return {"error": relative_error(out, ref), "dtype": str(dtype).removeprefix("torch."),
            "dtype_ok": out.dtype == dtype,
            "shape_ok": tuple(out.shape) == (*x.shape[:-1], N)}


def interpreter_cases() -> dict[str, dict]:
    """Every case run under the interpreter, keyed by name."""
    results = {}
    for M in (1, 3, 16):
        for config_name, config in CPU_CONFIGS.items():
            for dtype in (torch.float32, torch.bfloat16):
                for bias in (False, True):
                    name = f"M{M}-{config_name}-{str(dtype).removeprefix('torch.')}-{'bias' if bias else 'nobias'}"
                    results[name] = check_case(M, 50, 200, dtype, config, bias, "cpu")
    results["M3-fp16-bias"] = check_case(3, 50, 200, torch.float16, CPU_CONFIGS["reduce"], True, "cpu")
    results["M65-dot-tiles-rows"] = check_case(65, 40, 72, torch.bfloat16, CPU_CONFIGS["dot_swapped_split2"],
                                               True, "cpu")
    results["M16-reduce-tiles-rows"] = check_case(16, 40, 72, torch.float32, CPU_CONFIGS["reduce"], False, "cpu")
    results["strided-x"] = check_case(3, 50, 200, torch.bfloat16, CPU_CONFIGS["reduce_split3"], True, "cpu",
                                      x_layout="strided")
    results["batched-x"] = check_case(2, 50, 200, torch.float32, CPU_CONFIGS["dot_swapped"], False, "cpu",
                                      x_layout="batched")
    # the heuristic's own configs (interpreter counts 4 SMs, so K=2048 gets a 4-way split at M=1)
    for M in (1, 4, 16):
        results[f"heuristic-M{M}"] = check_case(M, 40, 2048, torch.bfloat16, None, True, "cpu")
    return results


@pytest.fixture(scope="module")
def interpreted() -> dict:
    return run_under_interpreter(Path(__file__))


def test_every_config_matches_f_linear_under_interpreter(interpreted):
    for name, result in interpreted.items():
        assert result["dtype_ok"] and result["shape_ok"], f"{name}: wrong output dtype or shape"
        assert result["error"] < TOLERANCE[result["dtype"]], f"{name}: relative error {result['error']:.3g}"
    assert len(interpreted) == 3 * len(CPU_CONFIGS) * 2 * 2 + 5 + 3


@pytest.mark.parametrize("model,layer,N,K", MODEL_SHAPES, ids=lambda v: str(v))
def test_choose_config_gives_a_valid_config_for_every_model_shape(model, layer, N, K):
    for M in (1, 2, 3, 4, 8, 16, 32, 64, 128, 256):
        config = choose_config(M, N, K, H100_SMS)
        sizes = (block_m_for(M, config), config.block_n, config.block_k)
        assert all(size & (size - 1) == 0 for size in sizes), f"M={M}: {sizes} not powers of two"
        assert not config.use_dot or min(sizes) >= 16, f"M={M}: tl.dot needs every tile side >= 16"
        assert 1 <= config.split_k <= -(-K // config.block_k), f"M={M}: split {config.split_k}"


def test_split_k_fills_the_gpu_when_n_tiles_are_few():
    # o_proj of 0.6B at M=1: 1024 / 16 = 64 column tiles for 132 SMs
    assert choose_config(1, 1024, 2048, H100_SMS).split_k > 1


def test_split_k_stays_off_when_n_tiles_fill_the_gpu():
    assert choose_config(1, 151936, 1024, H100_SMS).split_k == 1
    assert choose_config(64, 1024, 2048, H100_SMS).split_k == 1  # partials would cost more than they save


def test_mismatched_inputs_are_rejected_with_the_reason():
    w = torch.zeros(8, 16)
    with pytest.raises(ValueError, match="features"):
        skinny_linear(torch.zeros(2, 15), w)
    with pytest.raises(ValueError, match="cast"):
        skinny_linear(torch.zeros(2, 16, dtype=torch.float16), w)
    with pytest.raises(ValueError, match="bias"):
        skinny_linear(torch.zeros(2, 16), w, torch.zeros(7))


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("model,layer,N,K", MODEL_SHAPES, ids=lambda v: str(v))
def test_heuristic_matches_f_linear_on_model_shapes_on_gpu(model, layer, N, K):
    w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) / K ** 0.5
    b = torch.randn(N, device="cuda", dtype=torch.bfloat16)
    for M in (1, 3, 8, 16, 64, 100):
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        error = relative_error(skinny_linear(x, w, b), F.linear(x.float(), w.float(), b.float()))
        assert error < 1e-2, f"{model}/{layer} M={M}: relative error {error:.3g}"


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("config_name", list(CPU_CONFIGS))
def test_every_config_path_matches_f_linear_on_gpu(config_name):
    config = replace(CPU_CONFIGS[config_name], block_k=128)
    for M in (1, 3, 16):
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            result = check_case(M, 1000, 1000, dtype, config, True, "cuda")
            assert result["error"] < 1e-2, f"{config_name} M={M} {dtype}: relative error {result['error']:.3g}"


@pytest.mark.gpu
@needs_cuda
def test_split_k_replays_in_a_cuda_graph_with_new_inputs():
    w = torch.randn(1024, 2048, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(1024, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(1, 2048, device="cuda", dtype=torch.bfloat16)
    config = replace(choose_config(1, 1024, 2048, H100_SMS), split_k=4)
    skinny_linear(x, w, b, config=config)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = skinny_linear(x, w, b, config=config)
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        graph.replay()
        ref = F.linear(x.float(), w.float(), b.float())
        assert relative_error(out, ref) < 1e-2


if __name__ == "__main__":
    print(json.dumps(interpreter_cases()))
