"""RMSNorm (with the residual add), the gated activations (SiLU·mul, GELU-tanh·mul) and soft-capping as Triton
kernels: one program per row (RMSNorm) or per row and column block (the others).

They round where the eager torch layers round (engine/layers/fusion.py): the residual sum, the normalised row
before the weight product, the product (Gemma's norm, scaling by 1 + weight, rounds once, after it); act(gate)
before the product with up; each step of cap x tanh(x / cap).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.common import GATE_ACTS, gate_act, round_to, row_warps, tanh
from engine.kernels.launch import launch_dependents, pdl_options, wait_for_previous


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, hidden, stride_x, stride_r, stride_o, stride_ro,
                     eps, HAS_RESIDUAL: tl.constexpr, UNIT_OFFSET: tl.constexpr, BLOCK: tl.constexpr,
                     PDL: tl.constexpr):
    launch_dependents(PDL)
    row = tl.program_id(0)
    dtype = out_ptr.dtype.element_ty
    offs = tl.arange(0, BLOCK)
    mask = offs < hidden
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    wait_for_previous(PDL)
    h = tl.load(x_ptr + row.to(tl.int64) * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        h = round_to(h + tl.load(res_ptr + row.to(tl.int64) * stride_r + offs, mask=mask, other=0.0).to(tl.float32),
                   dtype)
        tl.store(res_out_ptr + row.to(tl.int64) * stride_ro + offs, h.to(dtype), mask=mask)
    inv = tl.math.rsqrt(tl.sum(h * h, axis=0) / hidden + eps)
    if UNIT_OFFSET:
        out = round_to(h * inv * (1.0 + w), dtype)
    else:
        out = round_to(w * round_to(h * inv, dtype), dtype)
    tl.store(out_ptr + row.to(tl.int64) * stride_o + offs, out.to(dtype), mask=mask)


@triton.jit
def _act_mul_kernel(x_ptr, out_ptr, width, stride_x, stride_o, ACT: tl.constexpr, BLOCK: tl.constexpr,
                    PDL: tl.constexpr):
    launch_dependents(PDL)
    wait_for_previous(PDL)
    row = tl.program_id(0)
    col = tl.program_id(1)
    dtype = out_ptr.dtype.element_ty
    offs = col * BLOCK + tl.arange(0, BLOCK)
    mask = offs < width
    src = x_ptr + row.to(tl.int64) * stride_x + offs
    gate = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(src + width, mask=mask, other=0.0).to(tl.float32)
    act = round_to(gate_act(gate, ACT), dtype)
    tl.store(out_ptr + row.to(tl.int64) * stride_o + offs, round_to(act * up, dtype).to(dtype), mask=mask)


@triton.jit
def _soft_cap_kernel(x_ptr, width, stride_x, cap, BLOCK: tl.constexpr, PDL: tl.constexpr):
    launch_dependents(PDL)
    wait_for_previous(PDL)
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < width
    ptrs = x_ptr + row.to(tl.int64) * stride_x + offs
    dtype = x_ptr.dtype.element_ty
    x = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    capped = round_to(round_to(tanh(round_to(x / cap, dtype)), dtype) * cap, dtype)
    tl.store(ptrs, capped.to(dtype), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
             unit_offset: bool = False):
    """rms_norm(x) or, with residual, (rms_norm(x + residual), x + residual), over the last dimension;
    unit_offset: scaled by 1 + weight (Gemma's) instead of weight."""
    hidden = x.shape[-1]
    x2 = x.reshape(-1, hidden)
    assert x2.stride(-1) == 1 and weight.shape == (hidden,)
    out = torch.empty_like(x2)
    res2 = res_out = x2  # unused without a residual
    if residual is not None:
        res2 = residual.reshape(-1, hidden)
        assert res2.stride(-1) == 1
        res_out = torch.empty_like(x2)
    if x2.shape[0]:
        block = triton.next_power_of_2(hidden)
        _rms_norm_kernel[(x2.shape[0],)](
            x2, res2, weight, out, res_out, hidden, x2.stride(0), res2.stride(0), out.stride(0), res_out.stride(0),
            eps, HAS_RESIDUAL=residual is not None, UNIT_OFFSET=unit_offset, BLOCK=block, num_warps=row_warps(block),
            **pdl_options(x2))
    if residual is None:
        return out.view(x.shape)
    return out.view(x.shape), res_out.view(x.shape)


def act_and_mul(x: torch.Tensor, act: str = "silu") -> torch.Tensor:
    """act(gate) * up over a packed [..., gate | up] input; act: "silu" or "gelu_tanh"."""
    if act not in GATE_ACTS:
        raise ValueError(f"activation {act!r} is not one of {', '.join(GATE_ACTS)}")
    width = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * width)
    assert x2.stride(-1) == 1
    out = torch.empty(x2.shape[0], width, dtype=x.dtype, device=x.device)
    if x2.shape[0]:
        block = min(1024, triton.next_power_of_2(width))
        _act_mul_kernel[(x2.shape[0], triton.cdiv(width, block))](
            x2, out, width, x2.stride(0), out.stride(0), ACT=act, BLOCK=block, num_warps=4, **pdl_options(x2))
    return out.view(*x.shape[:-1], width)


def soft_cap(x: torch.Tensor, cap: float) -> torch.Tensor:
    """x [rows, width] (rows contiguous) capped in place to cap x tanh(x / cap); returns x."""
    assert x.dim() == 2 and x.stride(1) == 1 and cap > 0
    if x.numel():
        block = min(1024, triton.next_power_of_2(x.shape[1]))
        _soft_cap_kernel[(x.shape[0], triton.cdiv(x.shape[1], block))](x, x.shape[1], x.stride(0), cap, BLOCK=block,
                                                                      num_warps=4, **pdl_options(x))
    return x
