"""Attention sinks (gpt-oss) in the Triton prefill, decode and fused-decode kernels and in the torch backend,
with and without sliding windows: under the Triton interpreter on CPU (a subprocess), and at gpt-oss-20b's
head sizes on CUDA."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from interpreter import run_under_interpreter  # noqa: E402
from sinks_cases import (CPU_CASES, FUSED_CPU_CASES, FUSED_GPU_CASES, GPU_CASES, check_fused_sinks,  # noqa: E402
                         check_sinks)
from test_kernels import assert_results  # noqa: E402

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")


def _checks(cases) -> int:
    """Checks check_sinks makes: sinks matter, prefill where a row has several tokens, three split counts,
    the backends and the torch backend against the reference, and under a window the pages before it handed
    back (that some are, and the outputs)."""
    return sum(6 + (max(q or [1]) > 1) + 2 * (window > 0) for _, _, _, _, _, q, _, window in cases)


@needs_triton
def test_attention_sinks_in_every_kernel_match_reference_under_interpreter():
    results = run_under_interpreter(Path(__file__).parent / "sinks_cases.py")
    assert len(results) == _checks(CPU_CASES) + 2 * len(FUSED_CPU_CASES), sorted(results)
    assert_results(results)


def test_sinks_that_dominate_leave_little_of_the_values():
    """The torch backend's sinks: a sink far above the scores takes nearly all the softmax's mass (output
    near 0), one far below leaves plain attention."""
    from engine.attention.torch_backend import attend

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 8, generator=gen) for _ in range(3))
    mask = torch.ones(3, 3, dtype=torch.bool).tril()
    plain = attend(q, k, v, mask, 0.35)
    out = attend(q, k, v, mask, 0.35, sinks=torch.tensor([40.0, -40.0]))
    assert out[0].abs().max() < 1e-10
    torch.testing.assert_close(out[1], plain[1])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_attention_sinks_in_every_kernel_match_reference_on_gpu():
    results = {**check_sinks("cuda", GPU_CASES), **check_fused_sinks("cuda", FUSED_GPU_CASES)}
    assert len(results) == _checks(GPU_CASES) + 2 * len(FUSED_GPU_CASES), sorted(results)
    assert_results(results)
