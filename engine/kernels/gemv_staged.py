"""y = x @ weight.T for one row of x, the weight slice staged in shared memory (a Gluon kernel; GPU only).

engine/kernels/gemv.py holds each program's weight slice in registers, loaded before its wait for the kernel
that writes x (programmatic dependent launch). At batch 1 that lets a projection's weights stream while the
kernels before it run, but only as far as the register file goes: with the attention kernel and the o
projection resident, the gate_up projection's programs do not fit, so they arrive late, and the down
projection's programs (launched only once every gate_up program has started) later still
(docs/kernels-notes.md, "Where a GEMV lets the next kernel start").

Here a program copies its [BLOCK_N, K] slice into shared memory with asynchronous copies (cp.async: no
registers hold the data in flight), lets the next kernel start, and only then waits for x. Shared memory
(228 KB an SM on the H100) is otherwise unused by the decode chain's GEMVs, so more of a layer's weights can
be on their way while its attention runs. After the wait, the program reads x (with the RMSNorm and residual
add, or SiLU·mul, in its prologue, rounded as engine/kernels/gemv.py rounds them), then its slice from
shared memory, part by part (PART columns at a time), and sums in float32.

One row only; K a multiple of PART. `takes` says whether a weight qualifies; `staged_setting` reads
REDLINE_GEMV_STAGED.
"""
from __future__ import annotations

import functools
import os

import torch
import triton

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
except ImportError:  # a Triton without Gluon: the staged kernel is never used
    gluon = gl = async_copy = None

from engine.kernels.launch import pdl_options

PART = 256           # columns of the slice a pass covers: 32 threads x 8 elements (16-byte copies)
MAX_SLICE = 32768    # weight elements a program stages (64 KB in bf16)
MIN_PROGRAMS = 128   # narrow the slices until N gives about this many programs
MAX_N = 65536        # larger weights (the LM head) stay on the register GEMV: nothing runs ahead of them
NUM_WARPS = 4


@functools.cache
def staged_setting() -> "bool | frozenset[tuple[int, int]]":
    """REDLINE_GEMV_STAGED: "0" (off, the default), "1" (every one-row projection that qualifies), or weight
    shapes "NxK,..." (or "NxK+...") to stage only those (for measurements)."""
    value = os.environ.get("REDLINE_GEMV_STAGED", "0")
    if value in ("0", "1"):
        return value == "1"
    try:
        shapes = frozenset(tuple(int(d) for d in item.split("x")) for item in value.replace("+", ",").split(","))
    except ValueError:
        shapes = frozenset()
    if not shapes or any(len(shape) != 2 for shape in shapes):
        raise ValueError(f"REDLINE_GEMV_STAGED must be 0, 1 or weight shapes like 6144x1024,1024x3072, got {value!r}")
    return shapes


@functools.cache
def _device_ok(device_index: int) -> bool:
    if gluon is None or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    return torch.cuda.get_device_capability(device_index)[0] >= 8


def takes(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether gemv_staged runs this projection: the setting on, one row on a GPU with Gluon, K a multiple of
    PART whose slice of at least NUM_WARPS rows fits in MAX_SLICE, and N at most MAX_N."""
    N, K = weight.shape
    setting = staged_setting()
    if not setting or (setting is not True and (N, K) not in setting):
        return False
    if not x.is_cuda or x.dim() != 2 or x.shape[0] != 1:
        return False
    index = x.device.index if x.device.index is not None else torch.cuda.current_device()
    return (_device_ok(index) and K % PART == 0 and NUM_WARPS * K <= MAX_SLICE and N <= MAX_N
            and x.dtype == weight.dtype and x.dtype in (torch.bfloat16, torch.float16))


def slice_rows(N: int, K: int) -> int:
    """BLOCK_N: the largest power of two of rows whose slice fits in MAX_SLICE and leaves about MIN_PROGRAMS
    programs where N allows, at least NUM_WARPS."""
    rows = NUM_WARPS
    while rows * 2 * K <= MAX_SLICE and rows < N and triton.cdiv(N, rows * 2) >= MIN_PROGRAMS:
        rows *= 2
    return rows


if gluon is not None:
    @gluon.jit
    def _pdl_launch(PDL: gl.constexpr):
        if PDL:
            gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // dummy $0", "=r", [], dtype=gl.int32,
                                      is_pure=False, pack=1)

    @gluon.jit
    def _pdl_wait(PDL: gl.constexpr):
        if PDL:
            gl.inline_asm_elementwise("griddepcontrol.wait; // dummy $0", "=r", [], dtype=gl.int32,
                                      is_pure=False, pack=1)

    @gluon.jit
    def _round(x, dtype: gl.constexpr):
        """x rounded to dtype and back to float32 (engine/kernels/qkv_prep.py's _round)."""
        if dtype == gl.bfloat16:
            bits = x.to(gl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
            return bits.to(gl.float32, bitcast=True)
        else:
            return x.to(dtype).to(gl.float32)

    @gluon.jit
    def _x_part(xs, us, rs, p, layout: gl.constexpr, GATED: gl.constexpr, HAS_RESIDUAL: gl.constexpr,
                dtype: gl.constexpr):
        """Part p of x from shared memory in float32: silu(gate) * up for a gated x, x + residual where there
        is one (rounded as the SiLU·mul and RMSNorm kernels round)."""
        x = xs.index(p).load(layout).to(gl.float32)
        if GATED:
            up = us.index(p).load(layout).to(gl.float32)
            x = _round(_round(x / (1.0 + gl.exp(-x)), dtype) * up, dtype)
        if HAS_RESIDUAL:
            x = _round(x + rs.index(p).load(layout).to(gl.float32), dtype)
        return x

    @gluon.jit
    def _staged_gemv_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, N, K, stride_wn, res_ptr, norm_w_ptr, res_out_ptr,
                            eps, BLOCK_N: gl.constexpr, PARTS: gl.constexpr, EVEN_N: gl.constexpr,
                            HAS_BIAS: gl.constexpr, GATED: gl.constexpr, NORM: gl.constexpr,
                            HAS_RESIDUAL: gl.constexpr, PDL: gl.constexpr):
        WARPS: gl.constexpr = gl.num_warps()
        layout: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [WARPS, 1], [1, 0])
        cols_layout: gl.constexpr = gl.SliceLayout(0, layout)
        rows_layout: gl.constexpr = gl.SliceLayout(1, layout)
        # vectors of 256 are copied by every thread once, without repeats
        copy_layout: gl.constexpr = gl.BlockedLayout([256 // (32 * WARPS)], [32], [WARPS], [0])
        shared: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
        vector: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
        dtype: gl.constexpr = out_ptr.dtype.element_ty
        ws = gl.allocate_shared_memory(w_ptr.dtype.element_ty, [PARTS, BLOCK_N, 256], shared)
        xs = gl.allocate_shared_memory(dtype, [PARTS, 256], vector)
        us = gl.allocate_shared_memory(dtype, [PARTS if GATED else 1, 256], vector)
        rs = gl.allocate_shared_memory(dtype, [PARTS if HAS_RESIDUAL else 1, 256], vector)
        ns = gl.allocate_shared_memory(dtype, [PARTS if NORM else 1, 256], vector)
        offs_n = gl.program_id(0) * BLOCK_N + gl.arange(0, BLOCK_N, layout=rows_layout)
        n_mask = offs_n < N
        if not EVEN_N:  # rows past N copy row N-1 and are not stored
            offs_n = gl.minimum(offs_n, N - 1)
        offs_k = gl.arange(0, 256, layout=cols_layout)
        w_ptrs = w_ptr + offs_n[:, None].to(gl.int64) * stride_wn + offs_k[None, :]
        for p in gl.static_range(PARTS):
            async_copy.async_copy_global_to_shared(ws.index(p), w_ptrs + p * 256)
        offs_c = gl.arange(0, 256, layout=copy_layout)
        if NORM:
            for p in gl.static_range(PARTS):
                async_copy.async_copy_global_to_shared(ns.index(p), norm_w_ptr + p * 256 + offs_c)
        async_copy.commit_group()
        if HAS_BIAS:
            bias = gl.load(bias_ptr + offs_n).to(gl.float32)
        _pdl_launch(PDL)
        _pdl_wait(PDL)  # x (and the residual) are written by an earlier kernel; the weights never are
        for p in gl.static_range(PARTS):  # x in one round trip: copied to shared memory, then read part by part
            async_copy.async_copy_global_to_shared(xs.index(p), x_ptr + p * 256 + offs_c)
            if GATED:
                async_copy.async_copy_global_to_shared(us.index(p), x_ptr + K + p * 256 + offs_c)
            if HAS_RESIDUAL:
                async_copy.async_copy_global_to_shared(rs.index(p), res_ptr + p * 256 + offs_c)
        async_copy.commit_group()
        async_copy.wait_group(0)
        gl.thread_barrier()  # every thread's copies are in shared memory
        if NORM:
            sq = gl.zeros([256], gl.float32, cols_layout)
            for p in gl.static_range(PARTS):
                x = _x_part(xs, us, rs, p, cols_layout, GATED, HAS_RESIDUAL, dtype)
                sq += x * x
            inv = gl.rsqrt(gl.sum(sq, axis=0) / K + eps)
        y = gl.zeros([BLOCK_N], gl.float32, rows_layout)
        for p in gl.static_range(PARTS):
            x = _x_part(xs, us, rs, p, cols_layout, GATED, HAS_RESIDUAL, dtype)
            if NORM:
                if HAS_RESIDUAL:
                    if gl.program_id(0) == 0:  # every program adds the residual; one writes the sum
                        gl.store(res_out_ptr + p * 256 + offs_k, x.to(dtype))
                x = _round(ns.index(p).load(cols_layout).to(gl.float32) * _round(x * inv, dtype), dtype)
            w = ws.index(p).load(layout).to(gl.float32)
            y += gl.sum(w * x[None, :], axis=1)
        if HAS_BIAS:
            y += bias
        gl.store(out_ptr + offs_n, y.to(dtype), mask=n_mask)


def gemv_staged(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, gated: bool = False,
                norm: "tuple[torch.Tensor | None, torch.Tensor, float] | None" = None,
                block_n: int | None = None, num_warps: int | None = None):
    """engine.kernels.gemv.gemv for one row of x (same arguments and results), the weight slice staged in
    shared memory. block_n, num_warps: rows a program stages (a power of two, at least num_warps) and its
    warps, in place of slice_rows and NUM_WARPS, for sweeps."""
    if gluon is None:
        raise RuntimeError("gemv_staged needs a Triton with Gluon (triton.experimental.gluon)")
    N, K = weight.shape
    width = 2 * K if gated else K
    if x.dim() != 2 or x.shape != (1, width) or not x.is_contiguous():
        raise ValueError(f"x must be one contiguous row [1, {width}] for a weight of [{N}, {K}], got {tuple(x.shape)}")
    if norm is not None and gated:
        raise ValueError("gemv_staged fuses either the RMSNorm or the SiLU·mul, not both")
    if K % PART or x.dtype != weight.dtype or weight.stride(1) != 1:
        raise ValueError(f"the weight needs x's dtype, contiguous rows and K a multiple of {PART}, got "
                         f"{tuple(weight.shape)} {weight.dtype}")
    num_warps = num_warps or NUM_WARPS
    if num_warps not in (1, 2, 4):  # x's copies are 256 // (32 * warps) elements a thread, at least 4 bytes
        raise ValueError(f"num_warps must be 1, 2 or 4, got {num_warps}")
    block_n = block_n or slice_rows(N, K)
    if block_n < num_warps or block_n & (block_n - 1) or block_n * K * x.element_size() > 200 * 1024:
        raise ValueError(f"block_n must be a power of two of at least {num_warps} rows whose slice fits in 200 KB, "
                         f"got {block_n}")
    residual, norm_weight, eps = norm if norm is not None else (None, None, 0.0)
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype or not residual.is_contiguous()):
        raise ValueError(f"the residual must be a contiguous [1, {K}] row like x, got {tuple(residual.shape)}")
    if norm_weight is not None and (norm_weight.shape != (K,) or not norm_weight.is_contiguous()):
        raise ValueError(f"the norm weight must be a contiguous [{K}] vector, got {tuple(norm_weight.shape)}")
    out = torch.empty(1, N, dtype=x.dtype, device=x.device)
    res_out = torch.empty_like(x) if residual is not None else None
    _staged_gemv_kernel[(triton.cdiv(N, block_n),)](
        x, weight, bias if bias is not None else weight, out, N, K, weight.stride(0),
        residual if residual is not None else x, norm_weight if norm_weight is not None else weight,
        res_out if res_out is not None else out, eps,
        BLOCK_N=block_n, PARTS=K // PART, EVEN_N=N % block_n == 0, HAS_BIAS=bias is not None, GATED=gated,
        NORM=norm_weight is not None, HAS_RESIDUAL=residual is not None, num_warps=num_warps, **pdl_options(x))
    return out if res_out is None else (out, res_out)
