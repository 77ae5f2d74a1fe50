"""Pieces shared by several of the engine's kernels: rounding as eager torch rounds, dot products, launch sizes."""
from __future__ import annotations

import functools

import torch
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


@functools.cache
def num_sms(device: torch.device) -> int:
    """The device's streaming multiprocessors (4 off CUDA: the interpreter's stand-in)."""
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def row_warps(block: int) -> int:
    """Warps of a program that holds one row of `block` elements."""
    return 4 if block <= 2048 else 8 if block <= 8192 else 16


@triton.jit
def round_to(x, dtype: tl.constexpr):
    """x rounded to the model dtype and back to float32, as an eager op's output would be."""
    if dtype == tl.bfloat16:
        # round to nearest even on the bits: the compiler folds a to(bf16).to(fp32) pair away
        bits = x.to(tl.float32).to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    else:
        return x.to(dtype).to(tl.float32)
