"""y = x @ weight.T for decode batches of tens of rows: bulk tensor copies and warpgroup MMAs (a Gluon
kernel; Hopper only).

cuBLAS spends 6-9 µs on each decode projection of the 0.6B shape at any row count from 16 to 256, where a
layer's weights take 10 µs at 3 TB/s for all four (H100). Its kernels cannot start on
their weights before the kernel that writes x has finished. Here each program owns a [BLOCK_M, BLOCK_N]
tile of y. Its weight tiles come through a ring of STAGES shared-memory buffers, filled by the copy engine
(TMA), and the first STAGES of them are requested before the program waits for the kernel that writes x
(programmatic dependent launch): the weights are on their way while that kernel runs. x's tiles follow
through their own ring, and a warpgroup MMA per K tile accumulates in float32 registers. With SPLIT > 1 the
K tiles are shared among SPLIT programs; each stores its float32 partial, and the program that takes the
last ticket of the tile sums the partials in split order (so the result does not depend on which finishes
first), stores y and resets the ticket.

It matches cuBLAS call for call rather than beating it (~6 µs a projection either way, 2da40e4 -
36a900d). In the engine's decode graphs it gains where its early weight requests overlap
the kernels between the projections, and where its gated epilogue (silu(gate) * up) replaces the SiLU·mul
kernel: 3-9% a step at 24-64 rows, which is where the layers take it (MIN_ROWS to MAX_ROWS).

CUDA-graph safe. `TmaConfig` holds the tile shape; `default_config` picks one from the shape.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch
import triton

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma,
                                                                   warpgroup_mma, warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
except ImportError:  # a Triton without Gluon's Hopper module: the kernel is never used
    gluon = gl = None

from engine.kernels.common import interpreted
from engine.kernels.launch import pdl_options


@dataclass(frozen=True)
class TmaConfig:
    block_m: int = 64     # 64 (4 warps, one warpgroup) or 128 (8 warps)
    block_n: int = 64     # a multiple of 8, at most 256
    block_k: int = 64     # 64 bf16 elements: the 128-byte swizzle's row
    stages: int = 4
    split: int = 1        # programs sharing one tile's K tiles

    @property
    def num_warps(self) -> int:
        return self.block_m // 16


@functools.cache
def _device_ok(device_index: int) -> bool:
    if gl is None or interpreted():
        return False
    return torch.cuda.get_device_capability(device_index)[0] == 9


def available(x: torch.Tensor) -> bool:
    """Whether the kernel can run on x's device (a Hopper GPU, Triton with Gluon)."""
    if not x.is_cuda:
        return False
    return _device_ok(x.device.index if x.device.index is not None else torch.cuda.current_device())


def default_config(M: int, N: int, K: int, num_sms: int = 132) -> TmaConfig:
    """The tiles that timed best at up to 64 rows on the 0.6B shapes (H100, 36a900d): 64 rows by
    64 columns, or for N of at most 2,048 (o, down) 16 columns with K split 4 ways; 8 stages. Past 64 rows
    (where cuBLAS was faster at every shape) 128 rows by the widest of 128/64/32 columns that keeps three
    quarters of the SMs busy."""
    k_tiles = triton.cdiv(K, 64)
    if M <= 64:
        if N <= 2048 and k_tiles % 4 == 0:
            return TmaConfig(64, 16, 64, max(2, min(8, k_tiles // 4)), 4)
        return TmaConfig(64, 64, 64, max(2, min(8, k_tiles)), 1)
    block_n = 128
    while block_n > 32 and triton.cdiv(N, block_n) * triton.cdiv(M, 128) < num_sms * 3 // 4:
        block_n //= 2
    return TmaConfig(128, block_n, 64, max(2, min(6, k_tiles)), 1)


# Weights it takes: at most MAX_N rows (the LM head stays on cuBLAS) and MAX_K columns. Only the 0.6B shape's
# projections (K of 1,024-3,072) have been timed against cuBLAS; the larger models' stay there until they are.
MAX_N = 65536
MAX_K = 3072


# Decode projections of MIN_ROWS to MAX_ROWS rows (that the GEMV does not take) run here on Hopper GPUs. Decode
# graphs of the 0.6B shape on the H100, against cuBLAS: 24-64 rows 1-9% faster, 8 rows 4% slower, 80-256 rows
# 0.5-19% slower; nano-bench -0.7% (36a900d).
MIN_ROWS = 24
MAX_ROWS = 64


def takes(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the layers run x @ weight.T here: MIN_ROWS to MAX_ROWS rows on a Hopper GPU, bf16 or fp16
    operands with rows the copy engine can address (16-byte aligned), a weight within MAX_N x MAX_K."""
    if x.dim() != 2 or not MIN_ROWS <= x.shape[0] <= MAX_ROWS or not available(x):
        return False
    if x.dtype != weight.dtype or x.dtype not in (torch.bfloat16, torch.float16):
        return False
    if weight.shape[0] > MAX_N or weight.shape[1] > MAX_K:
        return False
    if weight.shape[0] % 8:  # the output's rows, stored by the copy engine, must be 16-byte aligned
        return False
    return all(t.stride(1) == 1 and t.stride(0) % 8 == 0 and t.data_ptr() % 16 == 0 for t in (x, weight))


if gl is not None:
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
    def _copy_tile(desc, row, col, bar, dest, ok):
        mbarrier.expect(bar, desc.block_type.nbytes, pred=ok)
        tma.async_copy_global_to_shared(desc, [row, col], bar, dest, pred=ok)

    @gluon.jit
    def _copy_weights(desc, row, col, half_rows, bar, dest, ok, GATED: gl.constexpr):
        """A stage's weight tile; gated, its first half from the gate rows at `row`, its second from the up
        rows half_rows further on."""
        if GATED:
            HALF: gl.constexpr = desc.block_type.shape[0]
            mbarrier.expect(bar, 2 * desc.block_type.nbytes, pred=ok)
            tma.async_copy_global_to_shared(desc, [row, col], bar, dest.slice(0, HALF), pred=ok)
            tma.async_copy_global_to_shared(desc, [half_rows + row, col], bar, dest.slice(HALF, HALF), pred=ok)
        else:
            _copy_tile(desc, row, col, bar, dest, ok)

    @gluon.jit
    def _round(x, dtype: gl.constexpr):
        """x rounded to dtype and back to float32 (engine/kernels/common.py's round_to: bf16 by its bits,
        since the compiler folds a to(bf16).to(fp32) pair away)."""
        if dtype == gl.bfloat16:
            bits = x.to(gl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
            return bits.to(gl.float32, bitcast=True)
        else:
            return x.to(dtype).to(gl.float32)

    @gluon.jit
    def _tma_matmul_kernel(x_desc, w_desc, out_desc, out_ptr, part_ptr, counters_ptr, M, N, K, stride_om,
                           STAGES: gl.constexpr, SPLIT: gl.constexpr, GATED: gl.constexpr, PDL: gl.constexpr):
        BLOCK_M: gl.constexpr = x_desc.block_type.shape[0]
        BLOCK_K: gl.constexpr = x_desc.block_type.shape[1]
        # gated: the weight is [gate | up] rows, N of each; a program's tile holds BLOCK_N // 2 of each
        BLOCK_N: gl.constexpr = w_desc.block_type.shape[0] * (2 if GATED else 1)
        WARPS: gl.constexpr = gl.num_warps()
        dtype: gl.constexpr = x_desc.dtype
        off_n = gl.program_id(0) * w_desc.block_type.shape[0]
        off_m = gl.program_id(1) * BLOCK_M
        split = gl.program_id(2)
        tiles = gl.cdiv(K, BLOCK_K) // SPLIT
        first = split * tiles

        xs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, BLOCK_K], x_desc.layout)
        ws = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, BLOCK_K], w_desc.layout)  # one swizzle either way
        x_bar = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        w_bar = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(x_bar.index(i), count=1)
            mbarrier.init(w_bar.index(i), count=1)
        # the weights' first tiles before the wait: no kernel of the step writes them
        for i in gl.static_range(STAGES):
            _copy_weights(w_desc, off_n, (first + i) * BLOCK_K, N, w_bar.index(i), ws.index(i), i < tiles, GATED)
        _pdl_launch(PDL)
        _pdl_wait(PDL)
        for i in gl.static_range(STAGES):
            _copy_tile(x_desc, off_m, (first + i) * BLOCK_K, x_bar.index(i), xs.index(i), i < tiles)

        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                             instr_shape=[16, BLOCK_N, 16])
        acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, acc_layout)
        for t in range(tiles):
            s = t % STAGES
            phase = (t // STAGES) & 1
            mbarrier.wait(w_bar.index(s), phase)
            mbarrier.wait(x_bar.index(s), phase)
            acc = warpgroup_mma(xs.index(s), ws.index(s).permute((1, 0)), acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
            # tile t-1's MMA is complete: its stage takes tile t-1+STAGES
            refill = t - 1 + STAGES
            ok = (t > 0) & (refill < tiles)
            p = (t + STAGES - 1) % STAGES
            _copy_weights(w_desc, off_n, (first + refill) * BLOCK_K, N, w_bar.index(p), ws.index(p), ok, GATED)
            _copy_tile(x_desc, off_m, (first + refill) * BLOCK_K, x_bar.index(p), xs.index(p), ok)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(x_bar.index(i))
            mbarrier.invalidate(w_bar.index(i))

        if GATED:  # silu(gate) * up of the bf16 products, rounded as the SiLU·mul kernel rounds
            HALF: gl.constexpr = BLOCK_N // 2
            tile = gl.allocate_shared_memory(dtype, [BLOCK_M, BLOCK_N], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
            tile.store(acc.to(dtype))
            gl.thread_barrier()
            layout: gl.constexpr = gl.BlockedLayout([1, 1], [32 // HALF if HALF < 32 else 1,
                                                             HALF if HALF < 32 else 32], [WARPS, 1], [1, 0])
            gate = tile.slice(0, HALF, dim=1).load(layout).to(gl.float32)
            up = tile.slice(HALF, HALF, dim=1).load(layout).to(gl.float32)
            act = _round(_round(gate / (1.0 + gl.exp(-gate)), dtype) * up, dtype)
            rows = off_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, layout))
            cols = off_n + gl.arange(0, HALF, layout=gl.SliceLayout(0, layout))
            gl.store(out_ptr + rows[:, None].to(gl.int64) * stride_om + cols[None, :], act.to(dtype),
                     mask=(rows < M)[:, None] & (cols < N)[None, :])
        elif SPLIT == 1:
            out_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, BLOCK_N], out_desc.layout)
            out_smem.store(acc.to(dtype))
            fence_async_shared()
            tma.async_copy_shared_to_global(out_desc, [off_m, off_n], out_smem)
            tma.store_wait(pendings=0)
        else:
            rows = off_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, acc_layout))
            cols = off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, acc_layout))
            # partials [SPLIT, M_tiles * BLOCK_M, N] in float32
            m_pad = gl.num_programs(1) * BLOCK_M
            offs = rows[:, None].to(gl.int64) * N + cols[None, :]
            mask = (cols < N)[None, :] & (rows >= 0)[:, None]
            gl.store(part_ptr + split.to(gl.int64) * m_pad * N + offs, acc, mask=mask)
            gl.thread_barrier()  # every thread's partial stored before the ticket releases them
            counter = counters_ptr + gl.program_id(1) * gl.num_programs(0) + gl.program_id(0)
            ticket = gl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
            if ticket == SPLIT - 1:
                total = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, acc_layout)
                for i in gl.static_range(SPLIT):
                    total += gl.load(part_ptr + i * m_pad * N + offs, mask=mask, other=0.0, cache_modifier=".cg")
                out_mask = (rows < M)[:, None] & (cols < N)[None, :]
                gl.store(out_ptr + rows[:, None].to(gl.int64) * stride_om + cols[None, :], total.to(dtype),
                         mask=out_mask)
                gl.store(counter, 0)


def _gl_dtype(dtype: torch.dtype):
    return {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}[dtype]


_workspaces: dict = {}
_retired: list = []  # outgrown workspaces: a CUDA graph captured with one may still use it


def _workspace(device: torch.device, parts: int, tiles: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 partials of at least `parts` elements and `tiles` int32 tickets (zero; each tile's last program
    sets its ticket back to zero), grown as needed and kept per device."""
    part, counters = _workspaces.get(device, (None, None))
    if part is None or part.numel() < parts or counters.numel() < tiles:
        if part is not None:
            _retired.append((part, counters))
        part = torch.empty(max(parts, 1 << 20), device=device, dtype=torch.float32)
        counters = torch.zeros(max(tiles, 4096), device=device, dtype=torch.int32)
        _workspaces[device] = (part, counters)
    return part, counters


def tma_linear(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None,
               config: TmaConfig | None = None, gated: bool = False) -> torch.Tensor:
    """x [M, K] @ weight[N, K].T -> [M, N] in x's dtype (bf16 or fp16; rows of x, weight and out 16-byte
    aligned). gated: the weight is [gate | up] (N an even count of rows), and the result is the SiLU·mul of
    the product's halves, [M, N / 2], as engine.kernels.norm_act.act_and_mul of the product would give
    (no split K). Hopper GPUs only (`available`)."""
    if gl is None:
        raise RuntimeError("tma_linear needs Triton with Gluon's Hopper module")
    M, K = x.shape
    N = weight.shape[0] // 2 if gated else weight.shape[0]
    if weight.shape[1] != K or x.dtype != weight.dtype or x.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"tma_linear: x {tuple(x.shape)} {x.dtype} against weight {tuple(weight.shape)} "
                         f"{weight.dtype}")
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("tma_linear: x and weight need contiguous rows")
    if gated and weight.shape[0] % 2:
        raise ValueError(f"tma_linear: a gated weight has [gate | up] rows, an even count; got {weight.shape[0]}")
    config = config or default_config(M, weight.shape[0], K)
    if gated and (config.split != 1 or config.block_n % 16):
        config = replace(config, split=1, block_n=max(16, config.block_n - config.block_n % 16))
    if out is None:
        out = torch.empty(M, N, device=x.device, dtype=x.dtype)
    elif out.shape != (M, N) or out.dtype != x.dtype or out.stride(1) != 1:
        raise ValueError(f"tma_linear: out must be [{M}, {N}] {x.dtype} with contiguous rows, got "
                         f"{tuple(out.shape)} {out.dtype} strides {out.stride()}")
    dtype = _gl_dtype(x.dtype)
    bm, bn, bk = config.block_m, config.block_n, config.block_k
    w_rows = bn // 2 if gated else bn  # a gated tile's weight comes as two copies of half its rows
    x_desc = TensorDescriptor.from_tensor(x, [bm, bk], gl.NVMMASharedLayout.get_default_for([bm, bk], dtype))
    w_desc = TensorDescriptor.from_tensor(weight, [w_rows, bk],
                                          gl.NVMMASharedLayout.get_default_for([w_rows, bk], dtype))
    if gated:  # the epilogue stores through pointers; the descriptor argument is a stand-in
        out_desc = x_desc
    else:
        if (out.stride(0) * out.element_size()) % 16 or out.data_ptr() % 16:
            raise ValueError(f"tma_linear: out needs 16-byte aligned rows, got strides {out.stride()}")
        out_desc = TensorDescriptor.from_tensor(out, [bm, bn], gl.NVMMASharedLayout.get_default_for([bm, bn], dtype))
    grid = (triton.cdiv(N, w_rows), triton.cdiv(M, bm), config.split)
    if config.split > 1:
        if triton.cdiv(K, bk) % config.split:
            raise ValueError(f"tma_linear: {triton.cdiv(K, bk)} K tiles do not split {config.split} ways")
        part, counters = _workspace(x.device, config.split * grid[1] * bm * N, grid[0] * grid[1])
    else:
        part = counters = out
    _tma_matmul_kernel[grid](x_desc, w_desc, out_desc, out, part, counters, M, N, K, out.stride(0),
                             STAGES=config.stages, SPLIT=config.split, GATED=gated, num_warps=config.num_warps,
                             **pdl_options(x))
    return out
