"""A decode layer's whole MLP in one kernel for one or two rows: RMSNorm (with the residual add), gate and up,
SiLU·mul, and the down projection, instead of the gate_up GEMV and the down GEMV.

Program p owns BLOCK_I intermediate columns j: rows j of gate and up and column slice j of down. It issues
the loads of all three slices, lets the next kernel start, then waits for the kernel that writes x (the o
projection). So the down weights stream beside the kernels before it, as gate/up's do, instead of after the
gate_up GEMV, and a kernel boundary is gone. Each program's down product is a partial sum over its columns:
the programs add them into `sums` with integer atomics on int64 fixed point (value x 2^FIXED_BITS), which is
exact, so the sum does not depend on the order the programs finish in and a step's tokens repeat. The
kernel that reads the sum (gemv's x_fixed) converts it back and rounds to the model dtype, where the down
GEMV would have rounded its output.

Every rounding is the unfused chain's: gate and up rounded as gate_up's output, then SiLU·mul as gemv's
gated prologue rounds it. The sum differs from the down GEMV's only by where float32 rounds.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.launch import check_trace, launch_dependents, pdl_options, stamp, wait_for_previous
from engine.kernels.qkv_prep import _round

# 2^-28 resolution: a partial rounds by at most 1.9e-9, and a sum stays exact below 2^35 (3.4e10) in size
FIXED_BITS = 28
FIXED_SCALE = float(2 ** FIXED_BITS)
FIXED_STEP = tl.constexpr(1.0 / FIXED_SCALE)  # for kernels that read the sums (gemv's x_fixed)
MAX_ROWS = 2           # rows are unrolled, as gemv's row loop
MAX_SLICE = 24576      # weight elements a program holds: 3 x block_i x padded hidden size
MAX_PROGRAMS = 512     # each program adds a whole row of partials: more programs, more atomics
NUM_WARPS = 8
TRACE_POINTS = ("start", "waited", "done")
TRACE_WIDTH = len(TRACE_POINTS) + 1
TRACE_SLOTS = tl.constexpr(TRACE_WIDTH)


@triton.jit
def _mlp_kernel(x_ptr, res_ptr, res_out_ptr, norm_w_ptr, gu_ptr, down_ptr, sums_ptr, H, I, eps,
                stride_xm, stride_rm, stride_rom, stride_gu, stride_down, stride_sm, trace_ptr,
                BLOCK_I: tl.constexpr, BLOCK_H: tl.constexpr, EVEN_H: tl.constexpr, EVEN_I: tl.constexpr,
                ROWS: tl.constexpr, SCALE: tl.constexpr, PDL: tl.constexpr, TRACE: tl.constexpr):
    stamp(trace_ptr, 0, TRACE_SLOTS, TRACE)
    if ROWS > 1:
        launch_dependents(PDL)
    offs_i = tl.program_id(0) * BLOCK_I + tl.arange(0, BLOCK_I)
    i_mask = offs_i < I
    if not EVEN_I:  # columns past I read column I-1 and multiply a zero
        offs_i = tl.minimum(offs_i, I - 1)
    offs_h = tl.arange(0, BLOCK_H)
    h_mask = offs_h < H
    gate_ptrs = gu_ptr + offs_i[:, None].to(tl.int64) * stride_gu + offs_h[None, :]
    down_ptrs = down_ptr + offs_h[:, None].to(tl.int64) * stride_down + offs_i[None, :]
    if EVEN_H:
        gate = tl.load(gate_ptrs)
        up = tl.load(gate_ptrs + I * stride_gu)
        down = tl.load(down_ptrs)
    else:
        gate = tl.load(gate_ptrs, mask=h_mask[None, :], other=0.0)
        up = tl.load(gate_ptrs + I * stride_gu, mask=h_mask[None, :], other=0.0)
        down = tl.load(down_ptrs, mask=h_mask[:, None], other=0.0)
    norm_w = tl.load(norm_w_ptr + offs_h, mask=h_mask, other=0.0).to(tl.float32)
    if ROWS == 1:  # as gemv: with one row, the next kernel starts once the weight loads are issued
        launch_dependents(PDL)
    wait_for_previous(PDL)  # x is written by an earlier kernel; the weights never are
    stamp(trace_ptr, 1, TRACE_SLOTS, TRACE)
    dtype = res_out_ptr.dtype.element_ty
    for m in tl.static_range(ROWS):
        x = tl.load(x_ptr + m * stride_xm + offs_h, mask=h_mask, other=0.0).to(tl.float32)
        x = _round(x + tl.load(res_ptr + m * stride_rm + offs_h, mask=h_mask, other=0.0).to(tl.float32), dtype)
        if tl.program_id(0) == 0:  # every program sums the row; one writes the new residual
            tl.store(res_out_ptr + m * stride_rom + offs_h, x.to(dtype), mask=h_mask)
        inv = tl.math.rsqrt(tl.sum(x * x, axis=0) / H + eps)
        x = _round(norm_w * _round(x * inv, dtype), dtype)
        g = _round(tl.sum(gate.to(tl.float32) * x[None, :], axis=1), dtype)
        u = _round(tl.sum(up.to(tl.float32) * x[None, :], axis=1), dtype)
        act = _round(_round(g / (1.0 + tl.exp(-g)), dtype) * u, dtype)
        act = tl.where(i_mask, act, 0.0)
        partial = tl.sum(down.to(tl.float32) * act[None, :], axis=1)
        fixed = tl.floor(partial * SCALE + 0.5).to(tl.int64)
        tl.atomic_add(sums_ptr + m * stride_sm + offs_h, fixed, mask=h_mask, sem="relaxed")
    stamp(trace_ptr, 2, TRACE_SLOTS, TRACE)


def block_i(H: int, I: int) -> int | None:
    """Intermediate columns a program owns: the widest power of two whose three slices fit MAX_SLICE, or None
    where even the narrowest needs more than MAX_PROGRAMS programs (a larger model)."""
    padded = triton.next_power_of_2(H)
    width = 16
    while width > 1 and 3 * width * padded > MAX_SLICE:
        width //= 2
    if 3 * width * padded > MAX_SLICE or triton.cdiv(I, width) > MAX_PROGRAMS:
        return None
    return width


def fits(H: int, I: int) -> bool:
    return block_i(H, I) is not None


def fused_mlp(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
              gate_up_weight: torch.Tensor, down_weight: torch.Tensor, sums: torch.Tensor,
              width: int | None = None, num_warps: int | None = None, trace: torch.Tensor | None = None):
    """down(silu(gate) * up) of rms_norm(x + residual) x norm_weight, added into `sums` (int64 [M, H], zeros
    before the call, as fixed point: value x FIXED_SCALE); returns x + residual.

    x, residual: [M, H] (M at most MAX_ROWS) with contiguous rows; gate_up_weight [2I, H], packed [gate; up];
    down_weight [H, I]. width, num_warps: intermediate columns a program owns (a power of two) and its warps,
    for sweeps. trace: int64 [programs, TRACE_WIDTH], written as TRACE_POINTS says."""
    M, H = x.shape
    I = down_weight.shape[1]
    if not 0 < M <= MAX_ROWS:
        raise ValueError(f"fused_mlp takes 1 to {MAX_ROWS} rows, got {M}")
    if gate_up_weight.shape != (2 * I, H) or down_weight.shape != (H, I):
        raise ValueError(f"gate_up must be [2I, H] = [{2 * I}, {H}] and down [H, I] = [{H}, {I}], "
                         f"got {tuple(gate_up_weight.shape)} and {tuple(down_weight.shape)}")
    tensors = (x, residual, gate_up_weight, down_weight)
    if any(t.dtype != x.dtype or t.stride(-1) != 1 for t in tensors) or residual.shape != x.shape:
        raise ValueError("x, residual and the weights need one dtype and contiguous rows, residual x's shape")
    if norm_weight.shape != (H,) or not norm_weight.is_contiguous():
        raise ValueError(f"the norm weight must be a contiguous [{H}] vector, got {tuple(norm_weight.shape)}")
    if sums.dtype != torch.int64 or sums.shape != (M, H) or sums.stride(1) != 1:
        raise ValueError(f"sums must be int64 [{M}, {H}] with contiguous rows, got {sums.dtype} {tuple(sums.shape)}")
    width = width or block_i(H, I)
    if width is None or width & (width - 1) or 3 * width * triton.next_power_of_2(H) > 4 * MAX_SLICE:
        raise ValueError(f"no intermediate width fits a hidden size of {H} (see MAX_SLICE), got {width}")
    programs = triton.cdiv(I, width)
    check_trace(trace, programs, TRACE_WIDTH)
    res_out = torch.empty_like(x)
    block_h = triton.next_power_of_2(H)
    _mlp_kernel[(programs,)](
        x, residual, res_out, norm_weight, gate_up_weight, down_weight, sums, H, I, eps, x.stride(0),
        residual.stride(0), res_out.stride(0), gate_up_weight.stride(0), down_weight.stride(0), sums.stride(0),
        trace if trace is not None else sums,
        BLOCK_I=width, BLOCK_H=block_h, EVEN_H=H == block_h, EVEN_I=I % width == 0, ROWS=M, SCALE=FIXED_SCALE,
        TRACE=trace is not None, num_warps=num_warps or NUM_WARPS, **pdl_options(x))
    return res_out


def from_fixed(sums: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The sums as `dtype`, rounded as gemv's x_fixed reads them."""
    return (sums.to(torch.float32) * (1.0 / FIXED_SCALE)).to(dtype)
