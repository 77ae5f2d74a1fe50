"""W8A8 fp8 GEMMs on the tensor cores: y = x @ dequant(w).T (+ bias) for fp8 (e4m3) weights.

The activations are quantized to fp8 first (`quantize_rows`): each row's groups of `group` elements get a float32
scale amax / 448 (one group of the whole row for per-channel weights; 128 for block-wise weights, as DeepSeek's
and Qwen3-FP8's), or one static per-tensor scale. Then one GEMM over fp8 operands, accumulating in float32:
- block-wise weights (a float32 scale per block of BLOCK_N x BLOCK_K weights, `w_scale[scale_row[n], k //
  BLOCK_K]`): each K step of one weight block adds its product times the row's group scale and the columns' block
  scales; scale_row maps each output column to its scale row (packed parts keep their own blocks);
- per-channel weights (a per-tensor scale is one per channel): the row's and the column's scales multiply the
  accumulator once, in the epilogue.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.common import row_warps

FP8_MAX = 448.0  # the largest finite float8_e4m3fn
MIN_SCALE = 1e-12  # a row of zeros still divides by something


@triton.jit
def _quantize_kernel(x_ptr, q_ptr, s_ptr, static_ptr, K, stride_x, stride_q, stride_s, GROUP: tl.constexpr,
                     GROUP_BLOCK: tl.constexpr, NUM_GROUPS: tl.constexpr, STATIC: tl.constexpr):
    """One row: its groups as the rows of a [NUM_GROUPS, GROUP_BLOCK] tile, each with its own scale."""
    row = tl.program_id(0)
    groups = tl.arange(0, NUM_GROUPS)
    within = tl.arange(0, GROUP_BLOCK)
    cols = groups[:, None] * GROUP + within[None, :]
    mask = (within[None, :] < GROUP) & (cols < K)
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if STATIC:
        scale = tl.load(static_ptr + groups * 0)
    else:
        scale = tl.maximum(tl.max(tl.abs(x), axis=1) / 448.0, 1e-12)
        tl.store(s_ptr + row * stride_s + groups, scale, mask=groups * GROUP < K)
    q = _round_to_e4m3(tl.clamp(x / scale[:, None], -448.0, 448.0))
    tl.store(q_ptr + row * stride_q + cols, q.to(q_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _round_to_e4m3(v):
    """float32 v (|v| <= 448) rounded to nearest even e4m3 value, still in float32: the cast to fp8 after it is
    exact, so every conversion (the GPU's, the interpreter's) gives torch's values."""
    bits = v.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & 0xFFF00000  # 3 mantissa bits
    normal = bits.to(tl.float32, bitcast=True)
    subnormal = (v + 24576.0) - 24576.0  # below 2^-6 e4m3 steps by 2^-9, fp32's step at 1.5 x 2^14
    return tl.where(tl.abs(v) < 0.015625, subnormal, normal)


def quantize_rows(x: torch.Tensor, group: int | None = None,
                  static_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 rows, float32 scales [M, groups]) of x [M, K]: dynamic scales per row and group of `group` elements
    (None: the whole row); or with static_scale (a float32 tensor of one element), that scale for every row."""
    M, K = x.shape
    x = x if x.stride(1) == 1 else x.contiguous()
    group = group or K
    num_groups = triton.cdiv(K, group)
    q = torch.empty((M, K), dtype=torch.float8_e4m3fn, device=x.device)
    if static_scale is not None:
        scales = static_scale.reshape(1, 1).expand(M, 1)
        num_groups = 1
        group = K
    else:
        scales = torch.empty((M, num_groups), dtype=torch.float32, device=x.device)
    if M:
        group_block = triton.next_power_of_2(group)
        padded_groups = triton.next_power_of_2(num_groups)
        _quantize_kernel[(M,)](x, q, scales, static_scale if static_scale is not None else scales, K,
                               x.stride(0), q.stride(0), scales.stride(0), GROUP=group, GROUP_BLOCK=group_block,
                               NUM_GROUPS=padded_groups, STATIC=static_scale is not None,
                               num_warps=row_warps(group_block * padded_groups))
    return q, scales


@triton.jit
def _fp8_gemm_kernel(a_ptr, a_scale_ptr, b_ptr, b_scale_ptr, scale_row_ptr, bias_ptr, c_ptr, M, N, K,
                     stride_am, stride_bn, stride_cm, stride_asm, stride_bsn,
                     BLOCKWISE: tl.constexpr, HAS_BIAS: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    # groups of GROUP_M row tiles walk the columns together: their weight tiles stay in L2
    in_group = GROUP_M * num_n
    first_m = (pid // in_group) * GROUP_M
    group_size = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % in_group) % group_size
    pid_n = (pid % in_group) // group_size

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < N
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows[:, None] * stride_am + ks[None, :]
    b_ptrs = b_ptr + cols[None, :] * stride_bn + ks[:, None]
    if BLOCKWISE:
        a_scale_ptrs = a_scale_ptr + rows * stride_asm
        b_scale_ptrs = b_scale_ptr + tl.load(scale_row_ptr + cols, mask=col_ok, other=0) * stride_bsn

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        k_ok = ks < K - kb * BLOCK_K
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=col_ok[None, :] & k_ok[:, None], other=0.0)
        if BLOCKWISE:
            a_s = tl.load(a_scale_ptrs + kb, mask=row_ok, other=0.0)
            b_s = tl.load(b_scale_ptrs + kb, mask=col_ok, other=0.0)
            acc += tl.dot(a, b) * a_s[:, None] * b_s[None, :]
        else:
            acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K

    if not BLOCKWISE:
        a_s = tl.load(a_scale_ptr + rows * stride_asm, mask=row_ok, other=0.0)  # stride 0: a static scale
        acc = acc * a_s[:, None]
        acc = acc * tl.load(b_scale_ptr + cols, mask=col_ok, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    c_ptrs = c_ptr + rows[:, None] * stride_cm + cols[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def _tiles(M: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for M rows: column tiles narrow enough that a decode batch's
    weight stream is spread over every SM (Qwen3-8B's N=4096 projections: 128 programs), 128 x 128 for prefill.
    Chosen from the H100's 132 SMs and shared memory, not yet tuned by measurement."""
    if M <= 16:
        return 16, 32, 4, 6
    if M <= 64:
        return 64, 32, 4, 5
    if M <= 256:
        return 64, 128, 4, 4
    return 128, 128, 8, 3


def _gemm(a: torch.Tensor, a_scale: torch.Tensor, weight: torch.Tensor, w_scale: torch.Tensor,
          scale_row: torch.Tensor | None, bias: torch.Tensor | None, out_dtype: torch.dtype,
          block_k: int) -> torch.Tensor:
    M, K = a.shape
    N = weight.shape[0]
    out = torch.empty((M, N), dtype=out_dtype, device=a.device)
    if M == 0:
        return out
    block_m, block_n, warps, stages = _tiles(M)
    blockwise = scale_row is not None
    grid = (triton.cdiv(M, block_m) * triton.cdiv(N, block_n),)
    _fp8_gemm_kernel[grid](
        a, a_scale, weight, w_scale, scale_row if blockwise else w_scale, bias if bias is not None else out, out,
        M, N, K, a.stride(0), weight.stride(0), out.stride(0), a_scale.stride(0),
        w_scale.stride(0) if blockwise else 0,
        BLOCKWISE=blockwise, HAS_BIAS=bias is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=8, num_warps=warps, num_stages=stages)
    return out


def fp8_block_linear(x: torch.Tensor, weight: torch.Tensor, w_scale: torch.Tensor, scale_row: torch.Tensor,
                     block_k: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ dequant(weight [N, K] fp8).T with block scales w_scale [row blocks, ceil(K / block_k)] and each
    output column's scale row scale_row [N] (int32); activations quantized per row and group of block_k."""
    q, scales = quantize_rows(x, block_k)
    return _gemm(q, scales, weight, w_scale, scale_row, bias, x.dtype, block_k)


def fp8_channel_linear(x: torch.Tensor, weight: torch.Tensor, channel_scale: torch.Tensor,
                       bias: torch.Tensor | None = None, input_scale: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ dequant(weight [N, K] fp8).T with channel_scale [N] float32; activations quantized per row, or
    with the static input_scale (one float32 element)."""
    q, scales = quantize_rows(x, None, input_scale)
    return _gemm(q, scales, weight, channel_scale, None, bias, x.dtype, 128)
