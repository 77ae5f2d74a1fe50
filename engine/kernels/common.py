"""Triton pieces shared by several of the engine's kernels."""
from __future__ import annotations

import triton
import triton.language as tl
from triton import knobs


def interpreted() -> bool:
    """Whether Triton runs kernels under its CPU interpreter (TRITON_INTERPRET=1, as Triton itself reads it)."""
    return bool(knobs.runtime.interpret)


@triton.jit
def precise_dot(a, b, UPCAST: tl.constexpr, IEEE: tl.constexpr):
    """fp32 a @ b; fp32 operands in full precision (not tf32), bf16 upcast under the CPU interpreter."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)
