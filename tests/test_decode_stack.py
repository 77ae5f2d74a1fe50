"""decode_stack (engine/kernels/decode_stack.py): every decoder layer of a one-sequence decode step in one
persistent kernel, against a layer-by-layer torch reference on the same weights and caches.

On CPU the cases run under the Triton interpreter, one launch per phase (a spinning barrier cannot run
there). The persistent launch, its agreement with the phase launches and the engine's use of it need
CUDA and are marked `gpu`.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from decode_stack_cases import CPU_CASES, GPU_CASES, make_problem, run_case
from interpreter import run_under_interpreter

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
TOLERANCE = {"float32": 1e-5, "bfloat16": 2e-2}


def check(name: str, result: dict, tolerance: float) -> None:
    assert result["finite"], name
    for what in ("hidden", "residual", "cache"):
        assert result[what] < tolerance, (name, what, result)
    assert result["barrier_reset"], (name, "the barrier and tickets must be zero again after a launch")


@needs_triton
def test_decode_stack_matches_the_layer_by_layer_reference_under_interpreter():
    results = run_under_interpreter(Path(__file__).parent / "decode_stack_cases.py")
    assert len(results) == 2 * len(CPU_CASES), sorted(results)
    for name, result in results.items():
        check(name, result, TOLERANCE[name.rsplit("_", 1)[1]])


@needs_triton
def test_decode_stack_rejects_what_it_cannot_take():
    from engine.kernels.decode_stack import DecodeStack, StackShape, fits

    assert fits(StackShape(1024, 16, 8, 128, 3072), 132) is None   # Qwen3-0.6B on an H100
    assert "exceeds" in fits(StackShape(4096, 32, 8, 128, 12288), 132)  # Qwen3-8B: slices too large
    assert "power of two" in fits(StackShape(1024, 16, 8, 96, 3072), 132)
    assert "KV heads" in fits(StackShape(64, 4, 2, 16, 128), 1)
    weights, _ = make_problem(2, 64, 4, 2, 16, 128, 16, 10, True, torch.float32, "cpu")
    with pytest.raises(ValueError, match="o is"):
        DecodeStack([weights[0], {**weights[1], "o": weights[1]["o"][:, :32]}], 4, 2, 1e-6, 1e-6, 0.25, programs=4)
    with pytest.raises(ValueError, match="q/k norm"):
        DecodeStack([weights[0], {**weights[1], "q_norm": None}], 4, 2, 1e-6, 1e-6, 0.25, programs=4)
    stack = DecodeStack(weights, 4, 2, 1e-6, 1e-6, 0.25, programs=4)
    with pytest.raises(ValueError, match="one sequence"):
        stack(torch.zeros(1, 64), torch.zeros(2, dtype=torch.int64), torch.zeros(2, dtype=torch.int64),
              torch.ones(2, dtype=torch.int32), torch.zeros(4, dtype=torch.int32), torch.zeros(8, 8), torch.zeros(8, 8))


def test_stack_config_from_the_environment(monkeypatch):
    pytest.importorskip("triton")
    from engine.kernels.decode_stack import StackConfig, stack_config

    assert stack_config() == StackConfig()
    monkeypatch.setenv("REDLINE_STACK_CONFIG", "num_warps=16,l2_ahead=1")
    assert stack_config() == StackConfig(num_warps=16, l2_ahead=True)
    monkeypatch.setenv("REDLINE_STACK_CONFIG", "warps=8")
    with pytest.raises(ValueError, match="REDLINE_STACK_CONFIG"):
        stack_config()


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("case", GPU_CASES, ids=[c[0] for c in GPU_CASES])
def test_persistent_decode_stack_on_gpu(case):
    persistent = run_case(case, torch.bfloat16, "cuda", phases=False)
    check(case[0], persistent, TOLERANCE["bfloat16"])
    phases = run_case(case, torch.bfloat16, "cuda", phases=True)
    check(case[0], phases, TOLERANCE["bfloat16"])
    # the same arithmetic: the persistent launch and the phase launches agree to rounding
    assert abs(persistent["hidden"] - phases["hidden"]) < 2e-3, (persistent, phases)


def test_decode_stack_setting_rejects_other_values(monkeypatch):
    from engine.layers.stack import stack_setting

    def setting():
        stack_setting.cache_clear()  # read once per process in the engine
        return stack_setting()

    monkeypatch.delenv("REDLINE_DECODE_STACK", raising=False)
    assert setting() is False  # off by default: slower than the layer-by-layer chain so far
    monkeypatch.setenv("REDLINE_DECODE_STACK", "1")
    assert setting() is True
    monkeypatch.setenv("REDLINE_DECODE_STACK", "yes")
    with pytest.raises(ValueError, match="REDLINE_DECODE_STACK must be 0 or 1"):
        setting()
    monkeypatch.delenv("REDLINE_DECODE_STACK")
    stack_setting.cache_clear()
