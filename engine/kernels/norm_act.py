"""RMSNorm (with the residual add) and SiLU·mul as Triton kernels that can also warm the L2 cache.

A decode step of a small batch runs a few GEMMs a layer that each read megabytes of weights, with small
kernels in between that leave the memory bus idle. Each kernel here can be handed the weights of a GEMM
that comes a kernel or two later: it issues bulk L2 prefetches for them (Hopper's
`cp.async.bulk.prefetch.L2`, fire and forget: the kernel does not wait for them), so the GEMM finds
its weights in L2 instead of starting cold from HBM.

Both kernels round where the eager torch layers round (engine/layers/fusion.py): the residual sum, the
normalised row before the weight product, the product; silu(gate) before the product with up.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.qkv_prep import _round

PREFETCH_CHUNK = 32 << 10   # bytes per prefetch instruction
PREFETCH_LANES = 128        # prefetch instructions a program issues per loop iteration
MAX_TARGETS = 2             # weights one kernel can prefetch


@triton.jit
def _prefetch_l2(ptr, nbytes, pid, num_programs, CHUNK: tl.constexpr, LANES: tl.constexpr):
    """Queue L2 prefetches of nbytes from ptr, shared among num_programs programs; returns at once."""
    base = ptr.to(tl.pointer_type(tl.int8))
    num_chunks = tl.cdiv(nbytes, CHUNK)
    for first in range(pid * LANES, num_chunks, num_programs * LANES):
        chunk = first + tl.arange(0, LANES)
        offset = chunk.to(tl.int64) * CHUNK
        # the last chunk stops at the tensor's end (sizes are multiples of 16 bytes); lanes past it issue none
        size = tl.where(chunk < num_chunks, tl.minimum(nbytes - offset, CHUNK), 0).to(tl.int32) & ~15
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.b32 $0, 0; }",
            "=r,l,r", [base + offset, size], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _prefetch_targets(p0, n0, p1, n1, pid, num_programs, NUM_TARGETS: tl.constexpr,
                      CHUNK: tl.constexpr, LANES: tl.constexpr):
    if NUM_TARGETS >= 1:
        _prefetch_l2(p0, n0, pid, num_programs, CHUNK, LANES)
    if NUM_TARGETS >= 2:
        _prefetch_l2(p1, n1, pid, num_programs, CHUNK, LANES)


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, p0, n0, p1, n1,
                     hidden, stride_x, stride_r, stride_o, stride_ro, eps,
                     HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, NUM_TARGETS: tl.constexpr,
                     CHUNK: tl.constexpr, LANES: tl.constexpr):
    row = tl.program_id(0)
    dtype = out_ptr.dtype.element_ty
    _prefetch_targets(p0, n0, p1, n1, row, tl.num_programs(0), NUM_TARGETS, CHUNK, LANES)
    offs = tl.arange(0, BLOCK)
    mask = offs < hidden
    h = tl.load(x_ptr + row.to(tl.int64) * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        h = _round(h + tl.load(res_ptr + row.to(tl.int64) * stride_r + offs, mask=mask, other=0.0).to(tl.float32),
                   dtype)
        tl.store(res_out_ptr + row.to(tl.int64) * stride_ro + offs, h.to(dtype), mask=mask)
    inv = tl.math.rsqrt(tl.sum(h * h, axis=0) / hidden + eps)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    out = _round(w * _round(h * inv, dtype), dtype)
    tl.store(out_ptr + row.to(tl.int64) * stride_o + offs, out.to(dtype), mask=mask)


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, p0, n0, p1, n1, width, stride_x, stride_o,
                     BLOCK: tl.constexpr, NUM_TARGETS: tl.constexpr, CHUNK: tl.constexpr, LANES: tl.constexpr):
    row = tl.program_id(0)
    col = tl.program_id(1)
    dtype = out_ptr.dtype.element_ty
    pid = row * tl.num_programs(1) + col
    _prefetch_targets(p0, n0, p1, n1, pid, tl.num_programs(0) * tl.num_programs(1), NUM_TARGETS, CHUNK, LANES)
    offs = col * BLOCK + tl.arange(0, BLOCK)
    mask = offs < width
    src = x_ptr + row.to(tl.int64) * stride_x + offs
    gate = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(src + width, mask=mask, other=0.0).to(tl.float32)
    act = _round(gate / (1.0 + tl.exp(-gate)), dtype)
    tl.store(out_ptr + row.to(tl.int64) * stride_o + offs, _round(act * up, dtype).to(dtype), mask=mask)


def _targets(prefetch, filler: torch.Tensor) -> tuple[list, int]:
    """Kernel arguments (p0, n0, p1, n1) and their count from a list of (tensor, bytes); unused slots
    point at `filler` (a tensor on the kernel's device)."""
    assert len(prefetch) <= MAX_TARGETS, f"at most {MAX_TARGETS} prefetch targets"
    args = []
    for tensor, nbytes in prefetch:
        args += [tensor, nbytes]
    while len(args) < 2 * MAX_TARGETS:
        args += [filler, 0]
    return args, len(prefetch)


def _warps(block: int) -> int:
    return 4 if block <= 2048 else 8 if block <= 8192 else 16


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
             prefetch=()):
    """rms_norm(x) or, with residual, (rms_norm(x + residual), x + residual), over the last dimension.

    prefetch: up to two (tensor, bytes) pairs whose first `bytes` this kernel queues into L2 (CUDA only).
    """
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
        args, count = _targets(prefetch, x2)
        block = triton.next_power_of_2(hidden)
        _rms_norm_kernel[(x2.shape[0],)](
            x2, res2, weight, out, res_out, *args, hidden,
            x2.stride(0), res2.stride(0), out.stride(0), res_out.stride(0), eps,
            HAS_RESIDUAL=residual is not None, BLOCK=block, NUM_TARGETS=count,
            CHUNK=PREFETCH_CHUNK, LANES=PREFETCH_LANES, num_warps=_warps(block))
    if residual is None:
        return out.view(x.shape)
    return out.view(x.shape), res_out.view(x.shape)


def silu_and_mul(x: torch.Tensor, prefetch=()) -> torch.Tensor:
    """silu(gate) * up over a packed [..., gate | up] input; prefetch as in rms_norm."""
    width = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * width)
    assert x2.stride(-1) == 1
    out = torch.empty(x2.shape[0], width, dtype=x.dtype, device=x.device)
    if x2.shape[0]:
        args, count = _targets(prefetch, x2)
        block = min(1024, triton.next_power_of_2(width))
        _silu_mul_kernel[(x2.shape[0], triton.cdiv(width, block))](
            x2, out, *args, width, x2.stride(0), out.stride(0),
            BLOCK=block, NUM_TARGETS=count, CHUNK=PREFETCH_CHUNK, LANES=PREFETCH_LANES, num_warps=4)
    return out.view(*x.shape[:-1], width)
