"""LoRA's two products over a step's rows grouped by adapter slot: shrink (x @ A^T: each row's few LoRA
columns) and expand (out += y @ B^T).

The rows of each slot are cut into tiles of at most BLOCK_M rows, all of one slot (LoRATiles: the rows in
slot order and each tile's slot, first and end position in that order); a program takes one tile and one
block of output columns, loading its slot's A or B block once for all the tile's rows. A tile of slot -1 does
nothing, so a decode step's tiles can sit in fixed device buffers of max_tiles(rows) entries (CUDA graphs).

The shrink can compute its input from what the projection's own fused kernel read (so that an adapter leaves
the projection's fusions in place): the RMSNorm of the residual sum (`norm`), or SiLU(gate) x up of the packed
[gate | up] rows (`silu_and_mul`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from engine.kernels.common import interpreted

BLOCK_M = 16  # rows of a tile (tl.dot's smallest)
SHRINK_BLOCK_K = 64
SPLIT_MIN_K = 256  # the shrink splits K into parts of at least this many (a multiple of SHRINK_BLOCK_K)
MAX_SPLITS = 8


@dataclass
class LoRATiles:
    order: torch.Tensor       # [rows] int32: the rows under an adapter, grouped by slot (padded with 0)
    tile_slot: torch.Tensor   # [tiles] int32: each tile's slot, -1: an empty tile
    tile_start: torch.Tensor  # [tiles] int32: its first position in `order`
    tile_end: torch.Tensor    # [tiles] int32: one past its last


def max_tiles(rows: int, slots: int) -> int:
    """The most tiles `rows` rows spread over `slots` slots can need."""
    return triton.cdiv(rows, BLOCK_M) + slots


def make_tiles(slot_ids: torch.Tensor) -> tuple[list[int], list[int], list[int], list[int]]:
    """(order, tile slots, tile starts, tile ends) of a step's slot per row (-1: the base), on the host."""
    order, slots, starts, ends = [], [], [], []
    ids = slot_ids.tolist()
    for slot in sorted(set(ids) - {-1}):
        rows = [i for i, s in enumerate(ids) if s == slot]
        first = len(order)
        order += rows
        for start in range(first, len(order), BLOCK_M):
            slots.append(slot)
            starts.append(start)
            ends.append(min(start + BLOCK_M, len(order)))
    return order, slots, starts, ends


@triton.jit
def _tile_rows(order_ptr, tile_slot_ptr, tile_start_ptr, tile_end_ptr, tile, BLOCK_M: tl.constexpr):
    slot = tl.load(tile_slot_ptr + tile)
    start = tl.load(tile_start_ptr + tile)
    end = tl.load(tile_end_ptr + tile)
    pos = start + tl.arange(0, BLOCK_M)
    row_mask = pos < end
    rows = tl.load(order_ptr + pos, mask=row_mask, other=0).to(tl.int64)
    return slot, rows, row_mask


# what the shrink computes its input rows from
NO_PROLOGUE, NORM, SILU_AND_MUL = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)


@triton.jit
def _matmul_rows(src_ptr, src_stride, src_split_stride, w_ptr, w_stride_slot, w_stride_n, slot, rows, row_mask,
                 cols, col_mask, k_start, k_end, norm_ptr, rstd, up_offset, SPLITS: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr,
                 PROLOGUE: tl.constexpr = NO_PROLOGUE, UNIT_OFFSET: tl.constexpr = False):
    """src[rows][k_start:k_end] @ W[slot][cols][k_start:k_end]^T in float32: W [slots, N, K] contiguous in K; src
    the sum of SPLITS partial arrays src_split_stride apart (the shrink's split-K parts). PROLOGUE NORM: src
    rows scaled by their `rstd` and the norm's weight (1 + weight with UNIT_OFFSET); SILU_AND_MUL: SiLU(src) x
    the values up_offset further along each row."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < k_end
        src = src_ptr + rows[:, None] * src_stride + ks[None, :]
        x = tl.load(src, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        for part in tl.static_range(1, SPLITS):
            x += tl.load(src + part * src_split_stride, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        if PROLOGUE == NORM:
            scale = tl.load(norm_ptr + ks, mask=k_mask, other=0.0).to(tl.float32)
            if UNIT_OFFSET:
                scale += 1.0
            x = x.to(tl.float32) * rstd[:, None] * scale[None, :]
        elif PROLOGUE == SILU_AND_MUL:
            gate = x.to(tl.float32)
            up = tl.load(src + up_offset, mask=row_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
            x = gate / (1.0 + tl.exp(-gate)) * up
        w = tl.load(w_ptr + slot.to(tl.int64) * w_stride_slot + cols[None, :] * w_stride_n + ks[:, None],
                    mask=col_mask[None, :] & k_mask[:, None], other=0.0)
        if UPCAST:
            acc += tl.dot(x.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(x.to(w.dtype), w)
    return acc


@triton.jit
def _shrink_kernel(x_ptr, x_stride, a_ptr, a_stride_slot, y_ptr, y_stride, y_split_stride, order_ptr,
                   tile_slot_ptr, tile_start_ptr, tile_end_ptr, norm_ptr, eps, W, K, K_CHUNK, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr, PROLOGUE: tl.constexpr,
                   UNIT_OFFSET: tl.constexpr):
    """One tile, one block of LoRA columns, one chunk of K (program_id 2): its partial product into y's part."""
    tile = tl.program_id(0)
    slot, rows, row_mask = _tile_rows(order_ptr, tile_slot_ptr, tile_start_ptr, tile_end_ptr, tile, BLOCK_M)
    if slot < 0:
        return
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < W
    part = tl.program_id(2)
    k_start = part * K_CHUNK
    rstd = tl.zeros((BLOCK_M,), dtype=tl.float32)
    if PROLOGUE == NORM:  # each row's whole sum of squares, whichever part of K this program takes
        squares = tl.zeros((BLOCK_M,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            h = tl.load(x_ptr + rows[:, None] * x_stride + ks[None, :], mask=row_mask[:, None] & (ks < K)[None, :],
                        other=0.0).to(tl.float32)
            squares += tl.sum(h * h, axis=1)
        rstd = 1.0 / tl.sqrt(squares / K + eps)
    acc = _matmul_rows(x_ptr, x_stride, 0, a_ptr, a_stride_slot, K, slot, rows, row_mask, cols, col_mask, k_start,
                       tl.minimum(k_start + K_CHUNK, K), norm_ptr, rstd, K, 1, BLOCK_M, BLOCK_N, BLOCK_K, UPCAST,
                       PROLOGUE, UNIT_OFFSET)
    y = y_ptr + part.to(tl.int64) * y_split_stride + rows[:, None] * y_stride + cols[None, :]
    tl.store(y, acc, mask=row_mask[:, None] & col_mask[None, :])


@triton.jit
def _expand_kernel(y_ptr, y_stride, y_split_stride, b_ptr, b_stride_slot, out_ptr, out_stride, order_ptr,
                   tile_slot_ptr, tile_start_ptr, tile_end_ptr, N, W, SPLITS: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr):
    tile = tl.program_id(0)
    slot, rows, row_mask = _tile_rows(order_ptr, tile_slot_ptr, tile_start_ptr, tile_end_ptr, tile, BLOCK_M)
    if slot < 0:
        return
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    acc = _matmul_rows(y_ptr, y_stride, y_split_stride, b_ptr, b_stride_slot, W, slot, rows, row_mask, cols,
                       col_mask, 0, W, y_ptr, tl.zeros((BLOCK_M,), dtype=tl.float32), 0, SPLITS, BLOCK_M, BLOCK_N,
                       BLOCK_K, UPCAST)
    mask = row_mask[:, None] & col_mask[None, :]
    ptrs = out_ptr + rows[:, None] * out_stride + cols[None, :]
    old = tl.load(ptrs, mask=mask, other=0.0)
    tl.store(ptrs, (old.to(tl.float32) + acc).to(old.dtype), mask=mask)


def lora_add(x: torch.Tensor, out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, tiles: LoRATiles,
             norm: tuple[torch.Tensor, float, bool] | None = None, silu_and_mul: bool = False) -> torch.Tensor:
    """out[r] += (x[r] @ A[slot]^T) @ B[slot]^T for each row r under an adapter, in place; a [slots, W, K],
    b [slots, N, W]. The W LoRA columns of each row stay in float32 between the two products. With `norm`
    (weight, eps, unit_offset) the product is of x's rows RMS-normed; with `silu_and_mul`, x is [gate | up]
    (2K wide) and the product is of SiLU(gate) x up."""
    rows, k = x.shape
    slots, w, _ = a.shape
    n = out.shape[1]
    assert x.stride(1) == 1 and out.stride(1) == 1 and a.is_contiguous() and b.is_contiguous()
    prologue, norm_weight, eps, unit_offset = NO_PROLOGUE.value, x, 0.0, False
    if norm is not None:
        (norm_weight, eps, unit_offset), prologue = norm, NORM.value
        assert norm_weight.is_contiguous() and norm_weight.numel() == k
    elif silu_and_mul:
        k, prologue = k // 2, SILU_AND_MUL.value
    assert a.shape[2] == k
    # split K: a step's few tiles (256 rows over 8 adapters: 16) times one block of LoRA columns would leave
    # most SMs idle while each program walks all of K; the expand sums the parts as it loads them
    splits = max(1, min(MAX_SPLITS, k // SPLIT_MIN_K))
    k_chunk = triton.cdiv(triton.cdiv(k, splits), SHRINK_BLOCK_K) * SHRINK_BLOCK_K
    splits = triton.cdiv(k, k_chunk)
    y = torch.empty(splits, rows, w, dtype=torch.float32, device=x.device)
    num_tiles = tiles.tile_slot.numel()
    upcast = interpreted() or x.dtype == torch.float32
    block_w = max(16, triton.next_power_of_2(min(w, 64)))
    _shrink_kernel[(num_tiles, triton.cdiv(w, block_w), splits)](
        x, x.stride(0), a, a.stride(0), y, y.stride(1), y.stride(0), tiles.order, tiles.tile_slot,
        tiles.tile_start, tiles.tile_end, norm_weight, eps, w, k, k_chunk, BLOCK_M=BLOCK_M, BLOCK_N=block_w,
        BLOCK_K=SHRINK_BLOCK_K, UPCAST=upcast, PROLOGUE=prologue, UNIT_OFFSET=unit_offset)
    block_n = 64
    _expand_kernel[(num_tiles, triton.cdiv(n, block_n))](
        y, y.stride(1), y.stride(0), b, b.stride(0), out, out.stride(0), tiles.order, tiles.tile_slot,
        tiles.tile_start, tiles.tile_end, n, w, SPLITS=splits, BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_w,
        UPCAST=upcast)
    return out
