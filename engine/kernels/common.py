"""Pieces shared by several of the engine's kernels: rounding as eager torch rounds, dot products, launch sizes,
the activations."""
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


@triton.jit
def tanh(x):
    """tanh of float32 x from one exp2 (the interpreter has no libdevice tanh): (1 - e) / (1 + e) with
    e = exp(-2|x|), within a few ulps of 1 where |tanh| nears it (GELU's 1 + tanh of large negative
    inputs cancels there) and ~1e-7 absolute near 0."""
    e = tl.exp2(tl.abs(x) * -2.8853900817779268)  # exp(-2|x|) = exp2(-2 log2(e) |x|)
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def gate_act(x, ACT: tl.constexpr):
    """The gate's activation of a gated MLP, float32: "silu" (SwiGLU) or "gelu_tanh" (GeGLU with GELU's tanh
    approximation, torch's gelu(approximate="tanh"))."""
    if ACT == "gelu_tanh":
        return 0.5 * x * (1.0 + tanh(0.7978845608028654 * (x + 0.044715 * x * x * x)))  # sqrt(2 / pi)
    else:
        return x / (1.0 + tl.exp(-x))


GATE_ACTS = ("silu", "gelu_tanh")
