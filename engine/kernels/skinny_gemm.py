"""y = x @ weight.T (+ bias) for a few rows of x: the weight-streaming GEMM of small-batch decode.

With M of 1..64 the job is to read the weight once at full bandwidth. Grid: (M tile, N tile, K split).
Each program owns BLOCK_N output columns for BLOCK_M rows and walks its range of K in BLOCK_K tiles,
loading whole weight rows (K is contiguous) as wide coalesced vectors. Two inner products:
  - reduce (no tl.dot, BLOCK_M = next power of two of M, at most 8): broadcast-multiply in fp32 and
    sum over K; at BLOCK_M == 1 the sum waits until the end of the loop (no per-tile shuffles);
  - dot (BLOCK_M >= 16, padded rows masked): tl.dot, optionally swapped (weight tile as the MMA's M side,
    the "swap AB" trick) so a 64..128-row weight tile fills the tensor-core instruction instead of x.
When the N tiles alone cannot fill the GPU, K is split: each split writes an fp32 partial, and a second
kernel sums the partials in split order (deterministic), adds the bias and casts.

CUDA-graph safe: every size (grid, partial workspace) is a Python int from the shapes; nothing syncs.
The config comes from choose_config (shape rules, no autotuning); scripts/gemm_check.py measures it.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from engine.kernels.paged_tiles import upcast_dot

REDUCE_MAX_M = 8       # the reduce path's BLOCK_M is next_power_of_2(M), so at most 8 rows
DOT_MAX_BLOCK_M = 64   # larger M is tiled over the grid's first axis


@dataclass(frozen=True)
class SkinnyConfig:
    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3
    use_dot: bool = False
    swap_ab: bool = True  # dot path: weight tile on the MMA's M side, x on its N side
    block_m: int = 0      # dot path: rows of x a program takes; 0 picks from M (16..64)

    @property
    def name(self) -> str:
        kind = ("dotT" if self.swap_ab else "dot") if self.use_dot else "red"
        rows = f"_m{self.block_m}" if self.block_m else ""
        return (f"{kind}{rows}_n{self.block_n}_k{self.block_k}_s{self.split_k}"
                f"_w{self.num_warps}_st{self.num_stages}")


def block_m_for(M: int, config: SkinnyConfig) -> int:
    if config.use_dot:
        return config.block_m or min(max(16, triton.next_power_of_2(M)), DOT_MAX_BLOCK_M)
    return min(triton.next_power_of_2(M), REDUCE_MAX_M)


def choose_split_k(M: int, N: int, K: int, config: SkinnyConfig, num_sms: int) -> int:
    """1 when the output tiles alone give every SM a program (a split costs a second launch); else
    split K toward two programs per SM, keeping at least one K tile per split and the fp32 partials'
    traffic (written once, read once) under an eighth of the weight's bytes."""
    programs = triton.cdiv(M, block_m_for(M, config)) * triton.cdiv(N, config.block_n)
    if programs >= num_sms:
        return 1
    k_tiles = triton.cdiv(K, config.block_k)
    max_by_traffic = max(1, K // (32 * M))  # split * M * N * 4 B * 2 <= N * K * 2 B / 8
    split = 1
    while programs * split < 2 * num_sms and split * 2 <= min(k_tiles, max_by_traffic):
        split *= 2
    return split


def choose_config(M: int, N: int, K: int, num_sms: int) -> SkinnyConfig:
    """A config from the shape alone (no autotuning at call time)."""
    if M == 1:
        base = SkinnyConfig(block_n=16, block_k=512, num_warps=4, num_stages=3)
    elif M <= 4:
        base = SkinnyConfig(block_n=16, block_k=256, num_warps=4, num_stages=3)
    else:
        base = SkinnyConfig(block_n=64, block_k=128, num_warps=4, num_stages=4, use_dot=True, swap_ab=True)
    return replace(base, split_k=choose_split_k(M, N, K, base, num_sms))


@triton.jit
def _dot(a, b, UPCAST: tl.constexpr, IEEE: tl.constexpr):
    """fp32 a @ b; fp32 operands in full precision (not tf32), bf16 upcast under the CPU interpreter."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _skinny_kernel(
    x_ptr, w_ptr, bias_ptr, out_ptr, part_ptr,
    M, N, K, stride_xm, stride_wn, k_per_split,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    USE_DOT: tl.constexpr, SWAP_AB: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
    DIRECT: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    pid_m = tl.program_id(0)  # fastest axis: the M tiles of one weight slice run together and share it in L2
    pid_n = tl.program_id(1)
    split = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    if not EVEN_N:  # out-of-range weight rows read row N-1 instead of masking the hot loop
        offs_n = tl.minimum(offs_n, N - 1)
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn
    k_start = split * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)

    if USE_DOT:
        if SWAP_AB:
            acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        else:
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    elif BLOCK_M == 1:
        acc_k = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)

    # an explicit stage count makes Triton pipeline the reduce path's loads too (cp.async), not only dot operands
    for k0 in tl.range(k_start, k_end, BLOCK_K, num_stages=NUM_STAGES):
        k0 = tl.multiple_of(k0, BLOCK_K)
        if EVEN_K:
            w = tl.load(w_rows + (k0 + offs_k)[None, :])
            x = tl.load(x_rows + (k0 + offs_k)[None, :], mask=m_mask[:, None], other=0.0)
        else:
            k_mask = (k0 + offs_k) < k_end
            w = tl.load(w_rows + (k0 + offs_k)[None, :], mask=k_mask[None, :], other=0.0)
            x = tl.load(x_rows + (k0 + offs_k)[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        if USE_DOT:
            if SWAP_AB:
                acc += _dot(w, tl.trans(x), UPCAST, IEEE)
            else:
                acc += _dot(x, tl.trans(w), UPCAST, IEEE)
        elif BLOCK_M == 1:
            acc_k += w.to(tl.float32) * x.to(tl.float32)
        else:
            acc += tl.sum(x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)

    # rows/cols: output coordinates of each accumulator element, shaped to broadcast like acc
    rows = offs_m[:, None]
    cols = offs_n[None, :]
    mask = m_mask[:, None] & n_mask[None, :]
    if USE_DOT:
        if SWAP_AB:
            rows = offs_m[None, :]
            cols = offs_n[:, None]
            mask = m_mask[None, :] & n_mask[:, None]
    elif BLOCK_M == 1:
        acc = tl.sum(acc_k, axis=1)
        rows = pid_m
        cols = offs_n
        mask = n_mask
    if DIRECT:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + rows.to(tl.int64) * N + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:  # partials [split, M, N] in fp32
        tl.store(part_ptr + (split * M + rows).to(tl.int64) * N + cols, acc, mask=mask)


@triton.jit
def _split_k_reduce_kernel(part_ptr, bias_ptr, out_ptr, N, numel, num_splits,
                           HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    part_ptrs = part_ptr + offs
    for _ in range(num_splits):  # in split order, so the sum is deterministic
        acc += tl.load(part_ptrs, mask=mask, other=0.0)
        part_ptrs += numel
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs % N, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  config: SkinnyConfig | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) for x [..., K] with few rows and weight [N, K]; fp32 accumulation,
    output in x's dtype. `config` overrides choose_config; `out` ([M, N], contiguous) is written."""
    N, K = weight.shape
    if x.shape[-1] != K:
        raise ValueError(f"x has {x.shape[-1]} features but weight is [{N}, {K}]")
    if x.dtype != weight.dtype:
        raise ValueError(f"x is {x.dtype} but weight is {weight.dtype}; cast one of them")
    if weight.stride(1) != 1:
        raise ValueError("weight must be contiguous along K (weight.stride(1) == 1)")
    if bias is not None and (bias.shape != (N,) or not bias.is_contiguous()):
        raise ValueError(f"bias must be a contiguous [{N}] vector, got {tuple(bias.shape)}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, K)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    M = x2.shape[0]
    if out is None:
        out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    assert out.shape == (M, N) and out.is_contiguous() and out.dtype == x.dtype
    if M == 0:
        return out.reshape(*lead, N)
    config = config or choose_config(M, N, K, _num_sms(x.device))
    block_m = block_m_for(M, config)
    # whole K tiles per split; the split count is recomputed so no split is empty
    k_tiles = triton.cdiv(K, config.block_k)
    tiles_per_split = triton.cdiv(k_tiles, max(1, min(config.split_k, k_tiles)))
    split_k = triton.cdiv(k_tiles, tiles_per_split)
    part = torch.empty(split_k, M, N, dtype=torch.float32, device=x.device) if split_k > 1 else out
    grid = (triton.cdiv(M, block_m), triton.cdiv(N, config.block_n), split_k)
    _skinny_kernel[grid](
        x2, weight, bias if bias is not None else out, out, part,
        M, N, K, x2.stride(0), weight.stride(0), tiles_per_split * config.block_k,
        BLOCK_M=block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        USE_DOT=config.use_dot, SWAP_AB=config.swap_ab, UPCAST=config.use_dot and upcast_dot(x2),
        IEEE=x.dtype == torch.float32, DIRECT=split_k == 1, HAS_BIAS=bias is not None,
        EVEN_N=N % config.block_n == 0, EVEN_K=K % config.block_k == 0, NUM_STAGES=config.num_stages,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    if split_k > 1:
        block = 1024
        _split_k_reduce_kernel[(triton.cdiv(M * N, block),)](
            part, bias if bias is not None else out, out, N, M * N, split_k,
            HAS_BIAS=bias is not None, BLOCK=block, num_warps=4,
        )
    return out.reshape(*lead, N)
