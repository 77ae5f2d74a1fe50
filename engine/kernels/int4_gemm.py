"""y = x @ W (+ bias) with W an int4 weight in groups along K (W4A16: AWQ, GPTQ, compressed-tensors
pack-quantized, all repacked at load into one layout, engine/layers/quant/int4.py):

    qweight int32 [K / 8, N]    nibble j (bits 4j..4j+3) of qweight[i, n] is q[8i + j, n], in 0..15
    scales        [K / G, N]    the checkpoint's float dtype
    zeros   uint8 [K / G, N]    W[k, n] = (q[k, n] - zeros[k // G, n]) * scales[k // G, n]

Two kernels, both loading each packed word once (its eight nibbles shifted out in registers: a
[BLOCK_K / 8, 8, BLOCK_N] tile) and dequantizing it there (never a float copy of W in memory), accumulating in
float32 and rounding once:

  _gemm_kernel (prefill, more than GEMV_MAX_ROWS rows): tiles of BLOCK_M rows by BLOCK_N columns; each K step
    dequantizes a [BLOCK_K, BLOCK_N] weight tile, casts it to x's dtype and feeds tl.dot.
  _gemv_kernel (decode, 1 to GEMV_MAX_ROWS rows): each program owns BLOCK_N columns and one of SPLIT_K slices
    of K. Up to FMA_MAX_ROWS rows it multiplies-adds on the CUDA cores (one row: into a tile of partial sums
    reduced once at the end); past them its 16-row tiles go to tl.dot. Split-K gives a decode step's projections
    enough programs to fill the GPU: the slices' float32 partial sums are added in a fixed order by one small
    kernel after it (deterministic, unlike atomics), with the bias; with one slice the GEMV writes the output.

A tile of BLOCK_K rows lies in one group when BLOCK_K divides G (the usual G = 128): one row of scales and
zeros per tile; smaller groups load them per row. GPTQ's desc_act (g_idx) is handled at load by reordering K
(engine/layers/quant/int4.py), so these kernels only see groups of consecutive rows.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.common import interpreted, num_sms

GEMV_MAX_ROWS = 16
# up to this many rows the GEMV multiplies-adds on the CUDA cores; past them (to GEMV_MAX_ROWS) its tiles go to the
# tensor cores: at 16 rows each weight would take 32 FMAs a byte, past what the H100's CUDA cores give a byte of
# its bandwidth (~9). From the arithmetic, not yet measured.
FMA_MAX_ROWS = 4
# the GEMV's dequantized weight tile held in registers: this many elements a program
GEMV_TILE = 8192
SUM_BLOCK = 1024  # outputs a program of the split-K sum takes


@triton.jit
def _dequant_tile(q_ptr, s_ptr, z_ptr, k0, offs_n, n_mask, K, N, GROUP: tl.constexpr, BLOCK_K: tl.constexpr):
    """The float32 weights W[k0 + 8p + j, offs_n] as a [BLOCK_K / 8, 8, BLOCK_N] tile: each packed word loaded once,
    its eight nibbles shifted out (rows past K: any finite value; the activations there are 0)."""
    offs_p = tl.arange(0, BLOCK_K // 8)
    offs_j = tl.arange(0, 8)
    p_mask = k0 // 8 + offs_p < K // 8
    packed = tl.load(q_ptr + (k0 // 8 + offs_p)[:, None].to(tl.int64) * N + offs_n[None, :],
                     mask=p_mask[:, None] & n_mask[None, :], other=0)
    q = ((packed[:, None, :] >> (offs_j * 4)[None, :, None]) & 0xF).to(tl.float32)
    if GROUP % BLOCK_K == 0:  # the whole tile in group k0 // GROUP: one row of scales and zeros
        g = k0 // GROUP
        s = tl.load(s_ptr + g * N + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, None, :]
        z = tl.load(z_ptr + g * N + offs_n, mask=n_mask, other=0).to(tl.float32)[None, None, :]
    else:
        g = ((k0 + offs_p[:, None] * 8 + offs_j[None, :]) // GROUP).to(tl.int64)[:, :, None]
        mask = p_mask[:, None, None] & n_mask[None, None, :]
        s = tl.load(s_ptr + g * N + offs_n[None, None, :], mask=mask, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + g * N + offs_n[None, None, :], mask=mask, other=0).to(tl.float32)
    return (q - z) * s


@triton.jit
def _gemm_kernel(x_ptr, q_ptr, s_ptr, z_ptr, bias_ptr, out_ptr, M, N, K, stride_xm, stride_om,
                 GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, UPCAST: tl.constexpr):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask, n_mask = offs_m < M, offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a = tl.load(x_ptrs, mask=m_mask[:, None] & (offs_k[None, :] < K - k0), other=0.0)
        w = tl.reshape(_dequant_tile(q_ptr, s_ptr, z_ptr, k0, offs_n, n_mask, K, N, GROUP, BLOCK_K),
                       (BLOCK_K, BLOCK_N))
        acc += _dot(a, w, UPCAST)
        x_ptrs += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _dot(a, w, UPCAST: tl.constexpr):
    """a @ w in float32, w (float32 weights) cast to a's dtype: the value a dequantized weight of that dtype has."""
    if UPCAST:  # the interpreter's dot has no bf16: the same values in float32
        return tl.dot(a.to(tl.float32), w.to(a.dtype).to(tl.float32), input_precision="ieee")
    elif a.dtype == tl.float32:
        return tl.dot(a, w, input_precision="ieee")
    else:
        return tl.dot(a, w.to(a.dtype))


@triton.jit
def _gemv_kernel(x_ptr, q_ptr, s_ptr, z_ptr, part_ptr, bias_ptr, out_ptr, M, N, K, stride_xm, stride_om, k_per_split,
                 GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 DOT: tl.constexpr, UPCAST: tl.constexpr, SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr):
    """part[split, m, n]: the float32 sum over this program's slice of K of x[m, k] * W[k, n]; with one slice
    (SPLIT false), out[m, n] itself, plus the bias, in out's dtype. DOT: the rows
    against each tile on the tensor cores; else each row's multiply-adds on the CUDA cores (one row: into a tile of
    partial sums, reduced once after the loop, so no step waits on a reduction across threads)."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(1)
    n_mask = offs_n < N
    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_one = tl.zeros((BLOCK_K // 8, 8, BLOCK_N), dtype=tl.float32)  # one row: products summed once, at the end
    k_tile = tl.reshape(offs_k, (BLOCK_K // 8, 8))  # x's columns laid out as w's first two dimensions
    first = split * k_per_split
    for k0 in range(first, tl.minimum(first + k_per_split, K), BLOCK_K):
        w = _dequant_tile(q_ptr, s_ptr, z_ptr, k0, offs_n, n_mask, K, N, GROUP, BLOCK_K)
        if BLOCK_M == 1:
            x = tl.load(x_ptr + k0 + k_tile, mask=k_tile < K - k0, other=0.0)
            acc_one += x.to(tl.float32)[:, :, None] * w
        elif DOT:
            x = tl.load(x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + k0 + offs_k[None, :],
                        mask=m_mask[:, None] & (offs_k[None, :] < K - k0), other=0.0)
            acc += _dot(x, tl.reshape(w, (BLOCK_K, BLOCK_N)), UPCAST)
        else:
            for m in tl.static_range(BLOCK_M):
                x = tl.load(x_ptr + m * stride_xm + k0 + k_tile, mask=k_tile < tl.where(m < M, K - k0, 0), other=0.0)
                row = tl.sum(tl.sum(x.to(tl.float32)[:, :, None] * w, axis=1), axis=0)
                acc += tl.where(offs_m[:, None] == m, row[None, :], 0.0)
    if BLOCK_M == 1:
        acc = tl.sum(tl.sum(acc_one, axis=1), axis=0)[None, :]
    mask = m_mask[:, None] & n_mask[None, :]
    if SPLIT:
        tl.store(part_ptr + (split * M + offs_m[:, None]).to(tl.int64) * N + offs_n[None, :], acc, mask=mask)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        out_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _sum_parts_kernel(part_ptr, bias_ptr, out_ptr, M, N, stride_om, num_parts, HAS_BIAS: tl.constexpr,
                      BLOCK: tl.constexpr):
    """out[m, n] = sum of part[:, m, n] in order (+ bias[n]), in out's dtype."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < M * N
    total = tl.zeros((BLOCK,), dtype=tl.float32)
    for i in range(num_parts):
        total += tl.load(part_ptr + i * M * N + offs, mask=mask, other=0.0)
    col = offs % N
    if HAS_BIAS:
        total += tl.load(bias_ptr + col, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + (offs // N).to(tl.int64) * stride_om + col, total.to(out_ptr.dtype.element_ty), mask=mask)


def gemm_blocks(rows: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) of the prefill kernel. Chosen from the shapes, not yet
    tuned on a GPU."""
    if interpreted():
        return 16, 32, 32, 4, 1
    return (64 if rows <= 64 else 128), 128, 64, 8, 3


def gemv_blocks(rows: int, n: int, k: int, device: torch.device) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K) of the decode kernel: a [BLOCK_K, BLOCK_N] weight tile of GEMV_TILE
    elements (16 rows on the tensor cores past FMA_MAX_ROWS), and K split until there are about two programs per
    SM."""
    block_m = 16 if rows > FMA_MAX_ROWS else triton.next_power_of_2(max(rows, 1))
    block_n = 32 if interpreted() else 64
    block_k = max(16, min(128, GEMV_TILE // block_n))
    column_programs = triton.cdiv(n, block_n)
    steps = triton.cdiv(k, block_k)
    split = max(1, min(steps, 2 * num_sms(device) // column_programs))
    return block_m, block_n, block_k, split


def int4_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                bias: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ W [K, N] (+ bias), W given by (qweight, scales, zeros) as the module's docstring lays out;
    in x's dtype (into `out` [rows, N] where given)."""
    shape = x.shape
    x = x.reshape(-1, shape[-1])
    if x.stride(-1) != 1:
        x = x.contiguous()
    rows, k = x.shape
    n = qweight.shape[1]
    if out is None:
        out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    if rows == 0:
        return out.view(*shape[:-1], n)
    if rows <= GEMV_MAX_ROWS:
        block_m, block_n, block_k, split = gemv_blocks(rows, n, k, x.device)
        k_per_split = triton.cdiv(triton.cdiv(k, split), block_k) * block_k
        split = triton.cdiv(k, k_per_split)
        parts = torch.empty(split, rows, n, dtype=torch.float32, device=x.device) if split > 1 else out
        placeholder = bias if bias is not None else scales
        _gemv_kernel[(triton.cdiv(n, block_n), split)](
            x, qweight, scales, zeros, parts, placeholder, out, rows, n, k, x.stride(0), out.stride(0), k_per_split,
            GROUP=group_size, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, DOT=rows > FMA_MAX_ROWS,
            UPCAST=interpreted() and x.dtype != torch.float32, SPLIT=split > 1, HAS_BIAS=bias is not None,
            num_warps=4)
        if split > 1:  # one small kernel: the slices' sums in order, the bias, the cast
            _sum_parts_kernel[(triton.cdiv(rows * n, SUM_BLOCK),)](
                parts, placeholder, out, rows, n, out.stride(0), split, HAS_BIAS=bias is not None, BLOCK=SUM_BLOCK)
    else:
        block_m, block_n, block_k, warps, stages = gemm_blocks(rows)
        _gemm_kernel[(triton.cdiv(rows, block_m), triton.cdiv(n, block_n))](
            x, qweight, scales, zeros, bias if bias is not None else scales, out, rows, n, k, x.stride(0),
            out.stride(0), GROUP=group_size, HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n,
            BLOCK_K=block_k, UPCAST=interpreted() and x.dtype != torch.float32, num_warps=warps, num_stages=stages)
    return out.view(*shape[:-1], n)
