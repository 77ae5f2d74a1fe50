"""y = x @ weight.T (+ bias) for the few rows of a small decode batch, streaming the weight once.

One program owns BLOCK_N output columns: it loads its whole [BLOCK_N, K] slice of the weight into
registers, then computes every row of x against it. Launched with programmatic dependent launch
(engine/kernels/launch.py), a program issues the loads of its weight slice, lets the next kernel start
(with more than one row, it does so first thing), and only then waits for the kernel that writes x: the
weight reads of a GEMV overlap the kernels before it, which is what a batch-1 decode step, a chain of ~300
short kernels, spends most of its time without. Slices are sized to about 16K elements, at least ~128
programs where N allows.

CUDA-graph safe (every size is a Python int from the shapes; nothing syncs). Accumulates in float32 and
rounds once, as cuBLAS does.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.common import GATE_ACTS, gate_act, precise_dot, round_to
from engine.kernels.launch import launch_dependents, pdl_options, wait_for_previous
from engine.kernels.paged_tiles import upcast_dot

MAX_SLICE = 16384      # weight elements a program holds in registers
MIN_PROGRAMS = 128     # narrow the slices until N gives about this many programs
EIGHT_WARPS_ABOVE = 8192  # slices of more elements than this take 8 warps, others 4
# x rows up to which the layers take this kernel. Up to 2 rows each row is a pass
# over the slice on CUDA cores: on the H100 a 0.6B decode step is 36% faster than with cuBLAS at 1 row and
# 14% at 2. Past them the tensor-core kernel below: 6% faster at 3-4 rows, 15-27% slower at 8-16 (each
# program reads every x row, as many bytes as its weight slice at 16 rows; 57e719d), so 4.
MAX_ROWS = 4
ROW_LIMIT = 32  # the row loop is unrolled: one compiled variant per row count, so few rows only
# Above DOT_ABOVE_ROWS rows gemv runs on the tensor cores (_gemv_dot_kernel): a program holds a
# [block_n, K] weight slice (block_n 16, or 8 past DOT_WIDE_K columns) and multiplies all rows at once.
# Programs that hold more than DOT_SIXTEEN_WARPS_ABOVE elements of weight and x together take 16 warps,
# others 8. The layers take it for slices of at most DOT_MAX_SLICE elements: the 0.6B shape's (16K-24K)
# gain, the 8B's (32K, K=4096) made its 4-row decode step 1.65x slower on the H100.
DOT_ABOVE_ROWS = 2
DOT_MAX_SLICE = 24576
DOT_WIDE_K = 1024
DOT_SIXTEEN_WARPS_ABOVE = 65536
# Past DOT_ABOVE_ROWS rows the layers take gemv only for weights of at most DOT_MAX_N rows: the LM head's
# (vocabulary-sized) product is faster in cuBLAS there (0.115 against 0.130 ms at 4 rows, H100).
DOT_MAX_N = 65536


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
                 res_ptr, norm_w_ptr, res_out_ptr, stride_rm, stride_rom, eps,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr,
                 HAS_BIAS: tl.constexpr, GATED: tl.constexpr, NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                 ACT: tl.constexpr, UNIT_OFFSET: tl.constexpr, ROWS: tl.constexpr, PDL: tl.constexpr):
    if ROWS > 1:
        launch_dependents(PDL)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    if not EVEN_N:  # rows past N read row N-1 and are not stored
        offs_n = tl.minimum(offs_n, N - 1)
    offs_k = tl.arange(0, BLOCK_K)
    k_mask = offs_k < K
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    if EVEN_K:
        w = tl.load(w_ptrs)
    else:
        w = tl.load(w_ptrs, mask=k_mask[None, :], other=0.0)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_n).to(tl.float32)
    if NORM:
        norm_w = tl.load(norm_w_ptr + offs_k, mask=k_mask, other=0.0).to(tl.float32)
    # With one row, the next kernel may start once this program's weight loads are issued; with more, first
    # thing. Each is the faster where it is used, by 1.7-3% of a decode graph (99fe3fe, d8b7341).
    if ROWS == 1:
        launch_dependents(PDL)
    wait_for_previous(PDL)  # x is written by an earlier kernel; the weights never are
    w = w.to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    for m in tl.static_range(ROWS):  # unrolled, so every row's loads issue before the first row's sums
        x = tl.load(x_ptr + m * stride_xm + offs_k, mask=k_mask, other=0.0).to(tl.float32)
        if GATED:  # x row is [gate | up]: act(gate) * up, rounded as the activation kernel rounds
            up = tl.load(x_ptr + m * stride_xm + K + offs_k, mask=k_mask, other=0.0).to(tl.float32)
            x = round_to(round_to(gate_act(x, ACT), dtype) * up, dtype)
        if NORM:  # RMSNorm of the row (after the residual add), rounded as the RMSNorm kernel rounds
            if HAS_RESIDUAL:
                x = round_to(x + tl.load(res_ptr + m * stride_rm + offs_k, mask=k_mask, other=0.0).to(tl.float32),
                           dtype)
                if tl.program_id(0) == 0:  # every program sums the row; one writes the new residual
                    tl.store(res_out_ptr + m * stride_rom + offs_k, x.to(dtype), mask=k_mask)
            inv = tl.math.rsqrt(tl.sum(x * x, axis=0) / K + eps)
            if UNIT_OFFSET:  # Gemma's: scaled by 1 + weight, rounded once
                x = round_to(x * inv * (1.0 + norm_w), dtype)
            else:
                x = round_to(norm_w * round_to(x * inv, dtype), dtype)
        acc = tl.sum(w * x[None, :], axis=1)
        if HAS_BIAS:
            acc += bias
        tl.store(out_ptr + m * stride_om + offs_n, acc.to(dtype), mask=n_mask)


@triton.jit
def _dot_rows(x_ptr, stride_xm, offs_m, m_mask, cols, col_mask, K, GATED: tl.constexpr, ACT: tl.constexpr,
              dtype: tl.constexpr, COL_MASK: tl.constexpr):
    """Rows of x as float32 [groups, rows, columns of a group] (masked rows, and with COL_MASK masked
    columns, 0); gated: act(gate) * up of the row's [gate | up] halves, rounded as gemv's row loop rounds."""
    ptrs = x_ptr + offs_m[None, :, None].to(tl.int64) * stride_xm + cols
    mask = m_mask[None, :, None]
    if COL_MASK:
        mask = mask & col_mask
    x = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    if GATED:
        up = tl.load(ptrs + K, mask=mask, other=0.0).to(tl.float32)
        x = round_to(round_to(gate_act(x, ACT), dtype) * up, dtype)
    return x


@triton.jit
def _group_dot(w, x, UPCAST: tl.constexpr, IEEE: tl.constexpr):
    """sum over groups g of w[g] @ x[g].T: w [G, BLOCK_N, KG], x [G, rows, KG] -> float32 [BLOCK_N, rows].
    One MMA chain a group, so the warps share the K dimension instead of one warp walking all of it."""
    return tl.sum(precise_dot(w, tl.permute(x, (0, 2, 1)), UPCAST, IEEE), axis=0)


@triton.jit
def _gemv_dot_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
                     res_ptr, norm_w_ptr, res_out_ptr, stride_rm, stride_rom, eps,
                     BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, K1: tl.constexpr, G1: tl.constexpr,
                     K2: tl.constexpr, G2: tl.constexpr, EVEN_N: tl.constexpr, HAS_BIAS: tl.constexpr,
                     GATED: tl.constexpr, NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr, ACT: tl.constexpr,
                     UNIT_OFFSET: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr):
    """gemv for more rows on the tensor cores. The weight slice is held as two parts, columns [0, K1) and
    [K1, K1 + K2) (K1 the largest power of two not above K, K2 a power of two covering the rest, or 0), each
    [groups, BLOCK_N, columns of a group]; x is read after the wait in the same shape, BLOCK_M rows."""
    launch_dependents(PDL)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    if not EVEN_N:  # rows past N read row N-1 and are not stored
        offs_n = tl.minimum(offs_n, N - 1)
    KG1: tl.constexpr = K1 // G1
    cols1 = (tl.arange(0, G1)[:, None, None] * KG1 + tl.arange(0, KG1)[None, None, :])
    w_rows = w_ptr + offs_n[None, :, None].to(tl.int64) * stride_wn
    w1 = tl.load(w_rows + cols1)
    if NORM:
        nw1 = tl.load(norm_w_ptr + cols1).to(tl.float32)
    if K2 > 0:
        KG2: tl.constexpr = K2 // G2
        cols2 = K1 + (tl.arange(0, G2)[:, None, None] * KG2 + tl.arange(0, KG2)[None, None, :])
        col2_mask = cols2 < K
        w2 = tl.load(w_rows + cols2, mask=col2_mask, other=0.0)
        if NORM:
            nw2 = tl.load(norm_w_ptr + cols2, mask=col2_mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_n).to(tl.float32)
    wait_for_previous(PDL)  # x is written by an earlier kernel; the weights never are
    dtype = out_ptr.dtype.element_ty
    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    x1 = _dot_rows(x_ptr, stride_xm, offs_m, m_mask, cols1, None, K, GATED, ACT, dtype, False)
    if K2 > 0:
        x2 = _dot_rows(x_ptr, stride_xm, offs_m, m_mask, cols2, col2_mask, K, GATED, ACT, dtype, True)
    if NORM:  # RMSNorm of each row (after the residual add), rounded as the RMSNorm kernel rounds
        if HAS_RESIDUAL:
            res_rows = offs_m[None, :, None].to(tl.int64)
            row_mask = m_mask[None, :, None]
            x1 = round_to(x1 + tl.load(res_ptr + res_rows * stride_rm + cols1, mask=row_mask, other=0.0)
                        .to(tl.float32), dtype)
            if K2 > 0:
                x2 = round_to(x2 + tl.load(res_ptr + res_rows * stride_rm + cols2, mask=row_mask & col2_mask,
                                         other=0.0).to(tl.float32), dtype)
            if tl.program_id(0) == 0:  # every program sums the rows; one writes the new residual
                tl.store(res_out_ptr + res_rows * stride_rom + cols1, x1.to(dtype), mask=row_mask)
                if K2 > 0:
                    tl.store(res_out_ptr + res_rows * stride_rom + cols2, x2.to(dtype), mask=row_mask & col2_mask)
        squares = tl.sum(tl.sum(x1 * x1, axis=2), axis=0)
        if K2 > 0:
            squares += tl.sum(tl.sum(x2 * x2, axis=2), axis=0)
        inv = tl.math.rsqrt(squares / K + eps)[None, :, None]
        if UNIT_OFFSET:  # Gemma's: scaled by 1 + weight, rounded once
            x1 = round_to(x1 * inv * (1.0 + nw1), dtype)
            if K2 > 0:
                x2 = round_to(x2 * inv * (1.0 + nw2), dtype)
        else:
            x1 = round_to(nw1 * round_to(x1 * inv, dtype), dtype)
            if K2 > 0:
                x2 = round_to(nw2 * round_to(x2 * inv, dtype), dtype)
    acc = _group_dot(w1, x1.to(dtype), UPCAST, IEEE)
    if K2 > 0:
        acc += _group_dot(w2, x2.to(dtype), UPCAST, IEEE)
    if HAS_BIAS:
        acc += bias[:, None]
    tl.store(out_ptr + offs_m[None, :] * stride_om + offs_n[:, None], acc.to(dtype),
             mask=n_mask[:, None] & m_mask[None, :])


def slice_rows(N: int, K: int) -> int:
    """BLOCK_N: weight rows a program holds, a power of two from 1 to 32."""
    block_k = triton.next_power_of_2(K)
    rows = max(1, min(32, MAX_SLICE // block_k))
    while rows > 4 and triton.cdiv(N, rows) < MIN_PROGRAMS:
        rows //= 2
    return rows


def dot_parts(K: int) -> tuple[int, int]:
    """(K1, K2): the dot kernel's two column parts of a weight row, K1 the largest power of two not above K
    and K2 the power of two (at least 16) that covers the rest, or 0."""
    k1 = 1 << (K.bit_length() - 1)
    return k1, (max(16, triton.next_power_of_2(K - k1)) if K > k1 else 0)


def dot_block_n(K: int) -> int:
    return 16 if K <= DOT_WIDE_K else 8


def dot_fits(K: int, block_n: int | None = None) -> bool:
    """Whether the dot kernel can hold a [block_n, K] weight slice (and tl.dot's 16-column minimum)."""
    return K >= 16 and (block_n or dot_block_n(K)) * sum(dot_parts(K)) <= DOT_MAX_SLICE


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         gated: bool = False, norm: "tuple[torch.Tensor | None, torch.Tensor, float] | None" = None,
         block_n: int | None = None, num_warps: int | None = None, dot: bool | None = None, act: str = "silu",
         unit_offset: bool = False):
    """F.linear(x, weight, bias) for x [M, K] with few rows (each costs every program a pass over its
    slice) and weight [N, K], K contiguous; output in x's dtype. gated: x is [M, 2K], packed [gate | up],
    and the product is with act(gate) * up (the activation kernel fused in; act "silu" or "gelu_tanh").

    norm = (residual or None, norm weight [K], eps): the product is with rms_norm(x + residual) x norm
    weight (the RMSNorm kernel fused in; unit_offset: x (1 + norm weight), Gemma's), and the result is
    (output, x + residual), or just the output without a residual.

    block_n, num_warps: the weight rows a program holds (a power of two) and its warps, in place of the
    defaults (slice_rows; 8 warps above EIGHT_WARPS_ABOVE elements).

    dot: the tensor-core kernel (True), the row loop on CUDA cores (False), or (None) the tensor cores above
    DOT_ABOVE_ROWS rows where the slice fits (dot_fits) and no block_n is given."""
    N, K = weight.shape
    if norm is not None and gated:
        raise ValueError("gemv fuses either the RMSNorm or the SiLU·mul, not both")
    if act not in GATE_ACTS:
        raise ValueError(f"activation {act!r} is not one of {', '.join(GATE_ACTS)}")
    width = 2 * K if gated else K
    if x.dim() != 2 or x.shape[1] != width:
        raise ValueError(f"x must be [M, {width}] for a weight of [{N}, {K}]{' (gated)' if gated else ''}, "
                         f"got {tuple(x.shape)}")
    if x.dtype != weight.dtype or weight.stride(1) != 1 or x.stride(1) != 1:
        raise ValueError("x and weight need one dtype and contiguous rows")
    if bias is not None and (bias.shape != (N,) or not bias.is_contiguous()):
        raise ValueError(f"bias must be a contiguous [{N}] vector, got {tuple(bias.shape)}")
    M = x.shape[0]
    if M > ROW_LIMIT:
        raise ValueError(f"gemv takes at most {ROW_LIMIT} rows of x, got {M}; use F.linear for more")
    residual, norm_weight, eps = norm if norm is not None else (None, None, 0.0)
    if norm_weight is not None and (norm_weight.shape != (K,) or not norm_weight.is_contiguous()):
        raise ValueError(f"the norm weight must be a contiguous [{K}] vector, got {tuple(norm_weight.shape)}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype or residual.stride(1) != 1):
        raise ValueError(f"the residual must be [M, {K}] like x with contiguous rows, got {tuple(residual.shape)}")
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    res_out = torch.empty_like(x) if residual is not None else None
    if dot is None:
        dot = M > DOT_ABOVE_ROWS and block_n is None and dot_fits(K)
    if dot and M:
        return _gemv_dot(x, weight, bias, out, gated, residual, norm_weight, eps, res_out, block_n, num_warps, act,
                         unit_offset)
    block_n = block_n or slice_rows(N, K)
    block_k = triton.next_power_of_2(K)
    if block_n < 1 or block_n & (block_n - 1) or block_n * block_k > 4 * MAX_SLICE:
        raise ValueError(f"block_n must be a power of two of at most {4 * MAX_SLICE // block_k} rows, got {block_n}")
    programs = triton.cdiv(N, block_n)
    if M:
        res_in, res_to = (residual, res_out) if residual is not None else (x, x)  # placeholders without one
        _gemv_kernel[(programs,)](
            x, weight, bias if bias is not None else weight, out, M, N, K, x.stride(0), weight.stride(0),
            out.stride(0), res_in, norm_weight if norm_weight is not None else weight, res_to, res_in.stride(0),
            res_to.stride(0), eps, BLOCK_N=block_n, BLOCK_K=block_k, EVEN_N=N % block_n == 0, EVEN_K=K == block_k,
            HAS_BIAS=bias is not None, GATED=gated, NORM=norm is not None, HAS_RESIDUAL=residual is not None,
            ACT=act, UNIT_OFFSET=unit_offset, ROWS=M,
            num_warps=num_warps or (8 if block_n * block_k > EIGHT_WARPS_ABOVE else 4), **pdl_options(x))
    return out if res_out is None else (out, res_out)


def _gemv_dot(x, weight, bias, out, gated, residual, norm_weight, eps, res_out, block_n, num_warps, act,
              unit_offset):
    M, (N, K) = x.shape[0], weight.shape
    block_n = block_n or dot_block_n(K)
    if block_n < 1 or block_n & (block_n - 1) or not dot_fits(K, block_n):
        raise ValueError(f"the dot kernel takes a power-of-two block_n whose [block_n, {K}] slice has at most "
                         f"{DOT_MAX_SLICE} elements (K of at least 16), got block_n {block_n}")
    k1, k2 = dot_parts(K)
    block_m = triton.next_power_of_2(M)
    held = (block_n + block_m * (2 if gated else 1)) * (k1 + k2)
    num_warps = num_warps or (16 if held > DOT_SIXTEEN_WARPS_ABOVE else 8)
    programs = triton.cdiv(N, block_n)
    res_in, res_to = (residual, res_out) if residual is not None else (x, x)  # placeholders without one
    _gemv_dot_kernel[(programs,)](
        x, weight, bias if bias is not None else weight, out, M, N, K, x.stride(0), weight.stride(0),
        out.stride(0), res_in, norm_weight if norm_weight is not None else weight, res_to, res_in.stride(0),
        res_to.stride(0), eps, BLOCK_N=block_n, BLOCK_M=block_m, K1=k1, G1=min(num_warps, k1 // 16),
        K2=k2, G2=min(num_warps, max(1, k2 // 16)), EVEN_N=N % block_n == 0, HAS_BIAS=bias is not None,
        GATED=gated, NORM=norm_weight is not None, HAS_RESIDUAL=residual is not None, ACT=act,
        UNIT_OFFSET=unit_offset, UPCAST=upcast_dot(x),
        IEEE=x.dtype == torch.float32, num_warps=num_warps, **pdl_options(x))
    return out if res_out is None else (out, res_out)


def takes(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the layers use gemv for this x and weight (for a gated x, pass either half of it)."""
    N, K = weight.shape
    rows = x.shape[0] if x.dim() == 2 else 0
    return (x.is_cuda and 0 < rows <= MAX_ROWS and x.dtype == weight.dtype
            and x.dtype in (torch.bfloat16, torch.float16) and x.stride(1) == 1 and weight.stride(1) == 1
            and triton.next_power_of_2(K) <= MAX_SLICE
            and (rows <= DOT_ABOVE_ROWS or (dot_fits(K) and N <= DOT_MAX_N)))
