"""Every decoder layer of a one-sequence decode step in one persistent kernel.

A batch-1 decode step is a chain of kernels, five a layer (the qkv GEMV, the fused decode attention and
the o, gate_up and down GEMVs), and each one waits for the one before it to finish. Within a layer the
chain spends more time on those boundaries and on dependent latencies than the 30 MB of weights take
at full bandwidth (docs/kernels-notes.md). Here one program per SM does its share of every phase of
every layer, and the programs meet at a grid barrier between phases:

  A  residual add, RMSNorm and the qkv projection: each program a slice of the qkv rows;
  B  attention: each program one (KV head, split) range of the sequence's positions; the program whose
     range holds the new token normalises, rotates and stores that token's K and V; the last program of
     a KV head to take a ticket merges the partials (fused_decode's merge);
  C  the o projection: each program a slice of its rows;
  D  residual add, RMSNorm, the gate and up projections and SiLU·mul: each program a slice of the
     intermediate columns, gate and up rows together;
  E  the down projection: each program a slice of its rows.

Before it waits at a barrier, a program loads what the next phase reads that no phase writes: the next
projection's weight slice into registers, and the first tile of its K/V range (the new token's row is
patched in from registers, since its store comes later). So the weight stream does not stop at the
phase boundaries, and the attention reads start before the qkv projection is complete.

The grid must be resident all at once (the barriers spin): one program an SM, launched as a cooperative
grid where the device supports it, so that a grid that cannot be resident fails to launch instead of
hanging. `phase=` runs one phase of one layer per launch instead, without barriers: the same arithmetic
under the Triton interpreter (tests) and a reference for the persistent launch.

Status: correct (tests against a torch reference, on the GPU too) but slower than the layer-by-layer
chain it would replace: on the H100 the batch-1 decode graph takes 1.16 ms with it against 0.78 ms
without (docs/kernels-notes.md, "Every layer in one persistent kernel"), so the engine uses it only with
REDLINE_DECODE_STACK=1 (engine/layers/stack.py).

The roundings are those of the kernels it replaces (gemv's norm prologue, qkv_prep's q/k norm and
rotary, the SiLU·mul of the gated GEMV), so its hidden states agree with the layer-by-layer path up to
the order of the sums.
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from engine.kernels.fused_decode import _merge_group
from engine.kernels.paged_tiles import LOG2E
from engine.kernels.qkv_prep import _norm_rope, _round

# columns of the per-layer pointer table (int64 addresses)
PTR_NAMES = ("qkv", "o", "gate_up", "down", "input_norm", "post_norm", "q_norm", "k_norm", "k_cache", "v_cache")
NUM_PTRS = tl.constexpr(len(PTR_NAMES))
W_QKV, W_O, W_GATE_UP, W_DOWN, NORM_IN, NORM_POST, NORM_Q, NORM_K, K_CACHE, V_CACHE = (
    tl.constexpr(i) for i in range(len(PTR_NAMES)))
MAX_TILE = 32768   # weight elements of one slice a program holds in registers (gate and up: two slices)
PHASES = 5


@dataclass(frozen=True)
class StackConfig:
    # measured on the H100, 28 layers of the 0.6B shape alone (docs/kernels-notes.md): 8 warps 1.03-1.11 ms,
    # 16 warps 1.39-1.50; the L2 prefetch cost 0.08-0.11 ms
    num_warps: int = 8
    kv_tile: int = 32        # KV positions an attention program reads at once
    l2_ahead: bool = False   # at each layer's start, queue the program's later slices into L2
    spin_load: bool = False  # barriers poll with acquire loads instead of atomics


def stack_config() -> StackConfig:
    """The default config, or REDLINE_STACK_CONFIG="num_warps=8,kv_tile=16,l2_ahead=0" (for sweeps)."""
    return parse_stack_config(os.environ.get("REDLINE_STACK_CONFIG", ""))


def parse_stack_config(value: str) -> StackConfig:
    """A StackConfig from "FIELD=N,..." (empty: the default)."""
    fields = {}
    for item in filter(None, value.split(",")):
        name, _, number = item.partition("=")
        if name not in StackConfig.__dataclass_fields__ or not number.isdigit():
            raise ValueError(f"REDLINE_STACK_CONFIG: {item!r} is not FIELD=N with a field of {StackConfig.__name__}")
        fields[name] = bool(int(number)) if name in ("l2_ahead", "spin_load") else int(number)
    config = StackConfig(**fields)
    if config.num_warps not in (4, 8, 16, 32) or config.kv_tile not in (16, 32, 64, 128):
        raise ValueError(f"REDLINE_STACK_CONFIG: num_warps must be 4-32 and kv_tile 16-128 (powers of two), "
                         f"got {config}")
    return config


@triton.jit
def _layer_ptr(row, col: tl.constexpr, base):
    """The tensor of column `col` of a layer's table row: the row holds element offsets from `base` (a
    pointer argument, so its alignment is known and the loads vectorise; torch aligns every allocation
    to 256 bytes, so the offsets are multiples of 16 elements)."""
    return base + tl.multiple_of(tl.load(row + col), 16)


@triton.jit
def _load_acquire(ptr):
    return tl.inline_asm_elementwise("ld.acquire.gpu.global.b32 $0, [$1];", "=r,l", [ptr], dtype=tl.int32,
                                     is_pure=False, pack=1)


@triton.jit
def _grid_sync(bar_ptr, target, SPIN_LOAD: tl.constexpr):
    """Wait until every program has arrived (the counter reaches target); what each program stored before
    arriving is visible to every program after. SPIN_LOAD: poll with acquire loads, not atomics."""
    tl.debug_barrier()  # every thread's stores are issued before the release
    tl.atomic_add(bar_ptr, 1, sem="release", scope="gpu")
    if SPIN_LOAD:
        seen = _load_acquire(bar_ptr)
        while seen < target:
            seen = _load_acquire(bar_ptr)
    else:
        seen = tl.atomic_add(bar_ptr, 0, sem="acquire", scope="gpu")
        while seen < target:
            seen = tl.atomic_add(bar_ptr, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


@triton.jit
def _grid_release(bar_ptr):
    """After a program's last barrier: the last program out resets the counter for the next launch."""
    if tl.atomic_add(bar_ptr + 1, 1, sem="acq_rel", scope="gpu") == tl.num_programs(0) - 1:
        tl.store(bar_ptr, 0)
        tl.store(bar_ptr + 1, 0)


@triton.jit
def _slice(w_ptr, first, N: tl.constexpr, K: tl.constexpr, R: tl.constexpr, BR: tl.constexpr,
           BK: tl.constexpr):
    """Rows first..first+R-1 (those < N) of a [N, K] weight, as a [BR, BK] tile (zeros past them)."""
    offs_r = tl.arange(0, BR)
    rows = first + offs_r
    offs_k = tl.arange(0, BK)
    ptrs = w_ptr + rows[:, None].to(tl.int64) * K + offs_k[None, :]
    ptrs = tl.max_contiguous(tl.multiple_of(ptrs, [16, 16]), [1, 16])  # the table's addresses are aligned
    r_mask = (offs_r < R) & (rows < N)
    if K == BK:
        return tl.load(ptrs, mask=r_mask[:, None], other=0.0)
    return tl.load(ptrs, mask=r_mask[:, None] & (offs_k[None, :] < K), other=0.0)


@triton.jit
def _gate_up_slices(w_ptr, first, INTER: tl.constexpr, H: tl.constexpr, R: tl.constexpr, BR: tl.constexpr,
                    BH: tl.constexpr):
    """Rows first..first+R-1 of the gate half and of the up half of a packed [2 INTER, H] gate_up weight."""
    return (_slice(w_ptr, first, INTER, H, R, BR, BH), _slice(w_ptr + INTER * H, first, INTER, H, R, BR, BH))


@triton.jit
def _store_rows(out_ptr, first, acc, N: tl.constexpr, R: tl.constexpr, BR: tl.constexpr):
    offs_r = tl.arange(0, BR)
    rows = first + offs_r
    tl.store(out_ptr + rows, acc.to(out_ptr.dtype.element_ty), mask=(offs_r < R) & (rows < N))


@triton.jit
def _load_row(ptr, K: tl.constexpr, BK: tl.constexpr):
    """A vector another program wrote in an earlier phase, from L2 (.cg), as float32."""
    offs = tl.arange(0, BK)
    return tl.load(ptr + offs, mask=offs < K, other=0.0, cache_modifier=".cg").to(tl.float32)


@triton.jit
def _rms_norm(r, w_ptr, eps, K: tl.constexpr, BK: tl.constexpr, dtype: tl.constexpr):
    """rms_norm(r) x weight with the RMSNorm kernel's roundings (as gemv's norm prologue)."""
    offs = tl.arange(0, BK)
    inv = tl.math.rsqrt(tl.sum(r * r, axis=0) / K + eps)
    w = tl.load(w_ptr + offs, mask=offs < K, other=0.0).to(tl.float32)
    return _round(w * _round(r * inv, dtype), dtype)


@triton.jit
def _kv_rows(block_table_row, n0, end, last, stride_page, stride_slot, PAGE: tl.constexpr, BKV: tl.constexpr):
    """Cache row offsets [BKV] of positions n0.. (the block-table index clamped to the sequence, so an
    empty range reads no entry past it) and which of them are < end."""
    offs_n = n0 + tl.arange(0, BKV)
    valid = offs_n < end
    page = tl.load(block_table_row + tl.minimum(offs_n, last) // PAGE, mask=valid, other=0).to(tl.int64)
    return page * stride_page + (offs_n % PAGE) * stride_slot, valid, offs_n


@triton.jit
def _kv_tile(k_cache, v_cache, rows, valid, head_offset, HALF: tl.constexpr):
    offs = rows[:, None] + head_offset + tl.arange(0, HALF)[None, :]
    m = valid[:, None]
    k = tl.max_contiguous(tl.multiple_of(k_cache + offs, [16, 16]), [1, 16])  # head rows are aligned
    v = tl.max_contiguous(tl.multiple_of(v_cache + offs, [16, 16]), [1, 16])
    return (tl.load(k, mask=m, other=0.0), tl.load(k + HALF, mask=m, other=0.0),
            tl.load(v, mask=m, other=0.0), tl.load(v + HALF, mask=m, other=0.0))


@triton.jit
def _prefetch_slice(w_ptr, first, N: tl.constexpr, K: tl.constexpr, R: tl.constexpr, LANES: tl.constexpr):
    """Queue rows first..first+R-1 (those < N) of a [N, K] weight into L2: one bulk prefetch, issued by one
    thread (LANES: the program's threads, one lane each), waited for by nothing."""
    rows = tl.minimum(N - first, R)
    elem: tl.constexpr = w_ptr.dtype.element_ty.primitive_bitwidth // 8
    lane = tl.arange(0, LANES)
    size = tl.where(lane == 0, rows * (K * elem), 0).to(tl.int32)
    base = w_ptr.to(tl.pointer_type(tl.int8)) + first.to(tl.int64) * (K * elem) + lane * 0
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.b32 $0, 0; }",
        "=r,l,r", [base, size], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _attend_tile(q1, q2, k1, k2, v1, v2, offs_n, valid, last, kn1, kn2, vn1, vn2, m_i, l_i, acc1, acc2, qk_scale):
    """One KV tile of the online softmax (CUDA-core dot products: one query row per head). Position `last`
    takes the new token's K and V from registers."""
    new = (offs_n == last)[:, None]
    k1 = tl.where(new, kn1[None, :], k1.to(tl.float32))
    k2 = tl.where(new, kn2[None, :], k2.to(tl.float32))
    v1 = tl.where(new, vn1[None, :], v1.to(tl.float32))
    v2 = tl.where(new, vn2[None, :], v2.to(tl.float32))
    s = tl.sum(q1[:, None, :] * k1[None, :, :], axis=2) + tl.sum(q2[:, None, :] * k2[None, :, :], axis=2)
    s = tl.where(valid[None, :], s * qk_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc1 = acc1 * alpha[:, None] + tl.sum(p[:, :, None] * v1[None, :, :], axis=1)
    acc2 = acc2 * alpha[:, None] + tl.sum(p[:, :, None] * v2[None, :, :], axis=1)
    return m_new, l_i, acc1, acc2


@triton.jit
def _decode_stack_kernel(
    x_in_ptr, positions_ptr, slot_mapping_ptr, seqlens_k_ptr, block_table_ptr, cos_ptr, sin_ptr, table_ptr, base_ptr,
    res_m_ptr, res_a_ptr, x_down_ptr, x_o_ptr, qkv_ptr, attn_ptr, act_ptr, part_out_ptr, part_lse_ptr,
    tickets_ptr, bar_ptr, num_layers, layer0, stride_cos, stride_page, stride_slot, stride_khead,
    eps, qk_eps, qk_scale,
    H: tl.constexpr, BH: tl.constexpr, NQ: tl.constexpr, NKV: tl.constexpr, D: tl.constexpr,
    INTER: tl.constexpr, BI: tl.constexpr, BA: tl.constexpr,
    R_QKV: tl.constexpr, BR_QKV: tl.constexpr, R_O: tl.constexpr, BR_O: tl.constexpr,
    R_GU: tl.constexpr, BR_GU: tl.constexpr, R_DN: tl.constexpr, BR_DN: tl.constexpr,
    SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    PAGE: tl.constexpr, BKV: tl.constexpr, HAS_QK_NORM: tl.constexpr, PHASE: tl.constexpr,
    L2_AHEAD: tl.constexpr, LANES: tl.constexpr, SPIN_LOAD: tl.constexpr,
):
    """PHASE -1: every phase of layers 0..num_layers-1, barriers between them. PHASE 0..4: that phase of
    layer `layer0` only."""
    pid = tl.program_id(0)
    P = tl.num_programs(0)
    dtype = x_in_ptr.dtype.element_ty
    HALF: tl.constexpr = D // 2
    QKV_N: tl.constexpr = (NQ + 2 * NKV) * D
    A_N: tl.constexpr = NQ * D
    PERSISTENT: tl.constexpr = PHASE < 0

    # the step's sequence, and this program's attention range (the same in every layer)
    kv_head = pid % NKV
    split = pid // NKV
    attends = split < SPLITS
    seqlen = tl.load(seqlens_k_ptr)
    last = seqlen - 1
    pos = tl.load(positions_ptr)
    slot = tl.load(slot_mapping_ptr).to(tl.int64)
    per_split = tl.cdiv(tl.cdiv(seqlen, SPLITS), BKV) * BKV
    start = split * per_split
    end = tl.where(attends, tl.minimum(start + per_split, seqlen), 0)
    holds_new = attends & (split == last // tl.maximum(per_split, 1)) & (slot >= 0)
    offs_half = tl.arange(0, HALF)
    all_half = offs_half < HALF
    cos = _round(tl.load(cos_ptr + pos * stride_cos + offs_half), dtype)
    sin = _round(tl.load(sin_ptr + pos * stride_cos + offs_half), dtype)
    head_offset = kv_head * stride_khead
    rows0, valid0, offs_n0 = _kv_rows(block_table_ptr, start, end, last, stride_page, stride_slot, PAGE, BKV)
    offs_g = tl.arange(0, GROUP_PAD)
    g_mask = offs_g < GROUP
    heads = kv_head * GROUP + offs_g

    if PERSISTENT:
        layer_begin = 0
        layer_end = num_layers
        w_qkv = _slice(_layer_ptr(table_ptr, W_QKV, base_ptr), pid * R_QKV, QKV_N, H, R_QKV, BR_QKV, BH)
    else:
        layer_begin = layer0
        layer_end = layer0 + 1
    target = 0
    for layer in range(layer_begin, layer_end):
        row = table_ptr + layer * NUM_PTRS
        k_cache = _layer_ptr(row, K_CACHE, base_ptr)  # the cache holds the model's dtype
        v_cache = _layer_ptr(row, V_CACHE, base_ptr)

        if PERSISTENT and L2_AHEAD:  # this layer's later slices and the next layer's qkv slice, into L2
            _prefetch_slice(_layer_ptr(row, W_O, base_ptr), pid * R_O, H, A_N, R_O, LANES)
            _prefetch_slice(_layer_ptr(row, W_GATE_UP, base_ptr), pid * R_GU, INTER, H, R_GU, LANES)
            _prefetch_slice(_layer_ptr(row, W_GATE_UP, base_ptr) + INTER * H, pid * R_GU, INTER, H, R_GU, LANES)
            _prefetch_slice(_layer_ptr(row, W_DOWN, base_ptr), pid * R_DN, H, INTER, R_DN, LANES)
            if layer + 1 < layer_end:
                _prefetch_slice(_layer_ptr(row + NUM_PTRS, W_QKV, base_ptr), pid * R_QKV, QKV_N, H, R_QKV, LANES)

        # A: residual add, RMSNorm, qkv slice
        if PERSISTENT or PHASE == 0:
            if not PERSISTENT:
                w_qkv = _slice(_layer_ptr(row, W_QKV, base_ptr), pid * R_QKV, QKV_N, H, R_QKV, BR_QKV, BH)
            if layer == 0:
                r = _load_row(x_in_ptr, H, BH)
            else:
                r = _round(_load_row(x_down_ptr, H, BH) + _load_row(res_a_ptr, H, BH), dtype)
            offs_h = tl.arange(0, BH)
            if pid == 0:
                tl.store(res_m_ptr + offs_h, r.to(dtype), mask=offs_h < H)
            h = _rms_norm(r, _layer_ptr(row, NORM_IN, base_ptr), eps, H, BH, dtype)
            _store_rows(qkv_ptr, pid * R_QKV, tl.sum(w_qkv.to(tl.float32) * h[None, :], axis=1), QKV_N, R_QKV, BR_QKV)
            if PERSISTENT:  # the first tile of B's range: no phase writes it (the new token is patched in)
                k1, k2, v1, v2 = _kv_tile(k_cache, v_cache, rows0, valid0, head_offset, HALF)
                target += P
                _grid_sync(bar_ptr, target, SPIN_LOAD)

        # B: attention over this program's range; the last ticket of a KV head merges
        if PERSISTENT or PHASE == 1:
            if not PERSISTENT:
                k1, k2, v1, v2 = _kv_tile(k_cache, v_cache, rows0, valid0, head_offset, HALF)
            if attends:
                qrow = qkv_ptr + heads[:, None] * D + offs_half[None, :]
                q1 = tl.load(qrow, mask=g_mask[:, None], other=0.0, cache_modifier=".cg").to(tl.float32)
                q2 = tl.load(qrow + HALF, mask=g_mask[:, None], other=0.0, cache_modifier=".cg").to(tl.float32)
                q_w = _layer_ptr(row, NORM_Q, base_ptr)
                k_w = _layer_ptr(row, NORM_K, base_ptr)
                q1, q2 = _norm_rope(q1, q2, q_w, cos, sin, offs_half, all_half, qk_eps, D, HAS_QK_NORM, HALF, dtype)
                krow = qkv_ptr + (NQ + kv_head) * D + offs_half[None, :]
                vrow = krow + NKV * D
                kn1 = tl.load(krow, cache_modifier=".cg").to(tl.float32)
                kn2 = tl.load(krow + HALF, cache_modifier=".cg").to(tl.float32)
                kn1, kn2 = _norm_rope(kn1, kn2, k_w, cos, sin, offs_half, all_half, qk_eps, D, HAS_QK_NORM, HALF,
                                      dtype)
                vn1 = tl.load(vrow, cache_modifier=".cg").to(tl.float32)
                vn2 = tl.load(vrow + HALF, cache_modifier=".cg").to(tl.float32)
                dst = (slot // PAGE) * stride_page + (slot % PAGE) * stride_slot + head_offset + offs_half[None, :]
                if holds_new:
                    tl.store(k_cache + dst, kn1.to(dtype))
                    tl.store(k_cache + dst + HALF, kn2.to(dtype))
                    tl.store(v_cache + dst, vn1.to(dtype))
                    tl.store(v_cache + dst + HALF, vn2.to(dtype))
                kn1 = tl.reshape(kn1, [HALF])
                kn2 = tl.reshape(kn2, [HALF])
                vn1 = tl.reshape(vn1, [HALF])
                vn2 = tl.reshape(vn2, [HALF])
                m_i = tl.full([GROUP_PAD], -1.0e30, dtype=tl.float32)
                l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
                acc1 = tl.zeros([GROUP_PAD, HALF], dtype=tl.float32)
                acc2 = tl.zeros([GROUP_PAD, HALF], dtype=tl.float32)
                m_i, l_i, acc1, acc2 = _attend_tile(q1, q2, k1, k2, v1, v2, offs_n0, valid0, last, kn1, kn2, vn1,
                                                    vn2, m_i, l_i, acc1, acc2, qk_scale)
                for n0 in range(start + BKV, end, BKV):
                    rows, valid, offs_n = _kv_rows(block_table_ptr, n0, end, last, stride_page, stride_slot,
                                                   PAGE, BKV)
                    t1, t2, u1, u2 = _kv_tile(k_cache, v_cache, rows, valid, head_offset, HALF)
                    m_i, l_i, acc1, acc2 = _attend_tile(q1, q2, t1, t2, u1, u2, offs_n, valid, last, kn1, kn2,
                                                        vn1, vn2, m_i, l_i, acc1, acc2, qk_scale)
                has_keys = l_i > 0.0
                inv_l = 1.0 / tl.where(has_keys, l_i, 1.0)
                out1 = acc1 * inv_l[:, None]
                out2 = acc2 * inv_l[:, None]
                if SPLITS == 1:
                    o_ptrs = attn_ptr + heads[:, None] * D + offs_half[None, :]
                    tl.store(o_ptrs, out1.to(dtype), mask=g_mask[:, None])
                    tl.store(o_ptrs + HALF, out2.to(dtype), mask=g_mask[:, None])
                else:
                    lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
                    prow = heads * SPLITS + split
                    p_ptrs = part_out_ptr + prow[:, None] * D + offs_half[None, :]
                    tl.store(p_ptrs, out1, mask=g_mask[:, None])
                    tl.store(p_ptrs + HALF, out2, mask=g_mask[:, None])
                    tl.store(part_lse_ptr + prow, lse, mask=g_mask)
                    tl.debug_barrier()  # every thread's partial stored before the ticket releases them
                    ticket = tl.atomic_add(tickets_ptr + kv_head, 1, sem="acq_rel", scope="gpu")
                    if ticket == SPLITS - 1:
                        tl.store(tickets_ptr + kv_head, 0)
                        _merge_group(part_out_ptr, part_lse_ptr, attn_ptr, pid * 0, kv_head, NQ, SPLITS, SPLITS, 0,
                                     D, GROUP, D, SPLITS_PAD, 1)
            if PERSISTENT:
                w_o = _slice(_layer_ptr(row, W_O, base_ptr), pid * R_O, H, A_N, R_O, BR_O, BA)
                target += P
                _grid_sync(bar_ptr, target, SPIN_LOAD)

        # C: o projection slice
        if PERSISTENT or PHASE == 2:
            if not PERSISTENT:
                w_o = _slice(_layer_ptr(row, W_O, base_ptr), pid * R_O, H, A_N, R_O, BR_O, BA)
            a = _load_row(attn_ptr, A_N, BA)
            _store_rows(x_o_ptr, pid * R_O, tl.sum(w_o.to(tl.float32) * a[None, :], axis=1), H, R_O, BR_O)
            if PERSISTENT:
                w_gate, w_up = _gate_up_slices(_layer_ptr(row, W_GATE_UP, base_ptr), pid * R_GU, INTER, H, R_GU, BR_GU,
                                               BH)
                target += P
                _grid_sync(bar_ptr, target, SPIN_LOAD)

        # D: residual add, RMSNorm, gate and up slices, SiLU·mul
        if PERSISTENT or PHASE == 3:
            if not PERSISTENT:
                w_gate, w_up = _gate_up_slices(_layer_ptr(row, W_GATE_UP, base_ptr), pid * R_GU, INTER, H, R_GU, BR_GU,
                                               BH)
            r = _round(_load_row(x_o_ptr, H, BH) + _load_row(res_m_ptr, H, BH), dtype)
            offs_h = tl.arange(0, BH)
            if pid == 0:
                tl.store(res_a_ptr + offs_h, r.to(dtype), mask=offs_h < H)
            h = _rms_norm(r, _layer_ptr(row, NORM_POST, base_ptr), eps, H, BH, dtype)
            gate = _round(tl.sum(w_gate.to(tl.float32) * h[None, :], axis=1), dtype)
            up = _round(tl.sum(w_up.to(tl.float32) * h[None, :], axis=1), dtype)
            act = _round(_round(gate / (1.0 + tl.exp(-gate)), dtype) * up, dtype)
            _store_rows(act_ptr, pid * R_GU, act, INTER, R_GU, BR_GU)
            if PERSISTENT:
                w_down = _slice(_layer_ptr(row, W_DOWN, base_ptr), pid * R_DN, H, INTER, R_DN, BR_DN, BI)
                target += P
                _grid_sync(bar_ptr, target, SPIN_LOAD)

        # E: down projection slice
        if PERSISTENT or PHASE == 4:
            if not PERSISTENT:
                w_down = _slice(_layer_ptr(row, W_DOWN, base_ptr), pid * R_DN, H, INTER, R_DN, BR_DN, BI)
            a = _load_row(act_ptr, INTER, BI)
            _store_rows(x_down_ptr, pid * R_DN, tl.sum(w_down.to(tl.float32) * a[None, :], axis=1), H, R_DN, BR_DN)
            if PERSISTENT:
                # the next layer's qkv slice (after the last layer, its own again: a branch would keep the
                # old slice alive through the layer)
                next_row = table_ptr + tl.minimum(layer + 1, layer_end - 1) * NUM_PTRS
                w_qkv = _slice(_layer_ptr(next_row, W_QKV, base_ptr), pid * R_QKV, QKV_N, H, R_QKV, BR_QKV, BH)
                if layer + 1 < layer_end:
                    target += P
                    _grid_sync(bar_ptr, target, SPIN_LOAD)

    if PERSISTENT:
        _grid_release(bar_ptr)


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _block(n: int) -> int:
    return triton.next_power_of_2(n)


@dataclass(frozen=True)
class StackShape:
    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate: int


def _rows_per_program(n: int, programs: int) -> int:
    return triton.cdiv(n, programs)


def fits(shape: StackShape, programs: int) -> str | None:
    """None where decode_stack takes this shape on this many programs, else why not."""
    s = shape
    if s.head_dim < 16 or s.head_dim & (s.head_dim - 1):
        return f"head_dim {s.head_dim} is not a power of two >= 16"
    if s.num_heads % s.num_kv_heads:
        return f"{s.num_heads} query heads are not a multiple of {s.num_kv_heads} KV heads"
    if programs < s.num_kv_heads:
        return f"{programs} programs cannot give each of {s.num_kv_heads} KV heads one"
    qkv = (s.num_heads + 2 * s.num_kv_heads) * s.head_dim
    tiles = {"qkv": (qkv, s.hidden), "o": (s.hidden, s.num_heads * s.head_dim),
             "gate_up": (s.intermediate, s.hidden), "down": (s.hidden, s.intermediate)}
    for name, (n, k) in tiles.items():
        elements = _block(_rows_per_program(n, programs)) * _block(k)
        if elements > MAX_TILE:
            return f"the {name} slice of {elements} elements a program exceeds {MAX_TILE}"
    return None


class DecodeStack:
    """The decoder layers of one model for decode_stack: a table of each layer's weights and caches.

    layers: one dict per layer with the PTR_NAMES tensors: qkv [(H + 2 Hkv) D, hidden], o [hidden, H D],
    gate_up [2 I, hidden] (gate rows first), down [hidden, I], the two hidden-size norm weights, the q/k
    norm weights [D] (None for a model without them) and the layer's K and V caches [pages, page size,
    Hkv, D]. All in one dtype (bf16 or fp16), contiguous, on one device; the caches of every layer
    alike. The table holds their addresses: the tensors must stay where they are (the model's weights
    and caches do).
    """

    def __init__(self, layers: list[dict], num_heads: int, num_kv_heads: int, eps: float, qk_eps: float,
                 scale: float, programs: int | None = None, config: StackConfig | None = None):
        if not layers:
            raise ValueError("a decode stack needs at least one layer")
        first = layers[0]
        k_cache = first["k_cache"]
        self.device, self.dtype = k_cache.device, first["qkv"].dtype
        if self.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise ValueError(f"decode_stack takes bf16, fp16 or fp32 weights, got {self.dtype}")
        head_dim = k_cache.shape[3]
        hidden = first["input_norm"].shape[0]
        self.shape = StackShape(hidden, num_heads, num_kv_heads, head_dim, first["down"].shape[1])
        self.has_qk_norm = first["q_norm"] is not None
        s = self.shape
        qkv_rows = (num_heads + 2 * num_kv_heads) * head_dim
        expected = {"qkv": (qkv_rows, hidden), "o": (hidden, num_heads * head_dim),
                    "gate_up": (2 * s.intermediate, hidden), "down": (hidden, s.intermediate),
                    "input_norm": (hidden,), "post_norm": (hidden,), "q_norm": (head_dim,), "k_norm": (head_dim,),
                    "k_cache": tuple(k_cache.shape), "v_cache": tuple(k_cache.shape)}
        base = first["qkv"]  # the table holds element offsets from it (see _layer_ptr)
        rows = []
        for i, layer in enumerate(layers):
            if set(layer) != set(PTR_NAMES):
                raise ValueError(f"layer {i} must give exactly {PTR_NAMES}, got {sorted(layer)}")
            if (layer["q_norm"] is not None) != self.has_qk_norm or (layer["k_norm"] is not None) != self.has_qk_norm:
                raise ValueError(f"layer {i}: every layer needs both q/k norm weights or neither")
            row = []
            for name in PTR_NAMES:
                t = layer[name]
                if t is None:  # no q/k norm: a valid address the kernel never reads
                    t = layer["input_norm"]
                elif tuple(t.shape) != expected[name]:
                    raise ValueError(f"layer {i} {name} is {tuple(t.shape)}, expected {expected[name]}")
                if t.dtype != self.dtype or t.device != self.device:
                    raise ValueError(f"layer {i} {name} is {t.dtype} on {t.device}; the stack needs {self.dtype} "
                                     f"on {self.device}")
                if name.endswith("cache"):
                    if t.stride() != k_cache.stride() or t.stride(3) != 1:
                        raise ValueError(f"layer {i} {name}: every cache needs the strides {k_cache.stride()}")
                elif not t.is_contiguous():
                    raise ValueError(f"layer {i} {name} must be contiguous")
                offset, rest = divmod(t.data_ptr() - base.data_ptr(), t.element_size())
                if rest or offset % 16:
                    raise ValueError(f"layer {i} {name} is not aligned to 16 elements")
                row.append(offset)
            rows.append(row)
        self.table = torch.tensor(rows, dtype=torch.int64, device=self.device)
        self.base = base
        self.num_layers = len(layers)
        self.layers = layers  # what the table's addresses point into
        self.page_size = k_cache.shape[1]
        self.cache_strides = (k_cache.stride(0), k_cache.stride(1), k_cache.stride(2))
        self.eps, self.qk_eps, self.scale = eps, qk_eps, scale
        if programs is None:
            programs = _num_sms(self.device.index if self.device.index is not None
                                else torch.cuda.current_device()) if self.device.type == "cuda" else 4
        self.programs = programs
        self.config = config or stack_config()
        why = fits(self.shape, programs)
        if why is not None:
            raise ValueError(f"decode_stack does not take this model: {why}")
        self.tickets = torch.zeros(num_kv_heads, dtype=torch.int32, device=self.device)
        self.barrier = torch.zeros(2, dtype=torch.int32, device=self.device)

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor, seqlens_k: torch.Tensor,
                 block_table: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 phases: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden, residual) [1, hidden] after every layer, for the one sequence of a decode step: x its
        embedded token [1, hidden]; positions, slot_mapping [1] (int64); seqlens_k [1] (int32, this token
        included); block_table: its row of pages (int32); cos, sin: the rotary tables [positions, D / 2].
        The model's final norm takes them as its x and residual. K and V of the token are stored.
        phases: one launch per phase of each layer (no barriers) instead of the persistent kernel."""
        s = self.shape
        if x.shape != (1, s.hidden) or x.dtype != self.dtype or x.device != self.device:
            raise ValueError(f"x must be [1, {s.hidden}] {self.dtype} on {self.device}, got {tuple(x.shape)} "
                             f"{x.dtype} on {x.device}")
        if positions.numel() != 1 or slot_mapping.numel() != 1 or seqlens_k.numel() != 1:
            raise ValueError("decode_stack takes one sequence: positions, slot_mapping and seqlens_k of one element")
        if block_table.dim() != 1 or block_table.dtype != torch.int32 or block_table.stride(0) != 1:
            raise ValueError("block_table must be the sequence's contiguous int32 row of pages")
        assert cos.shape == sin.shape and cos.stride() == sin.stride() and cos.stride(1) == 1
        assert cos.shape[1] == s.head_dim // 2
        P, dev, dtype = self.programs, self.device, self.dtype
        qkv_n = (s.num_heads + 2 * s.num_kv_heads) * s.head_dim
        splits = P // s.num_kv_heads
        new = functools.partial(torch.empty, device=dev, dtype=dtype)
        res_m, res_a, x_down, x_o = new(1, s.hidden), new(1, s.hidden), new(1, s.hidden), new(1, s.hidden)
        qkv, attn, act = new(qkv_n), new(s.num_heads * s.head_dim), new(s.intermediate)
        part_out = torch.empty(s.num_heads, splits, s.head_dim, device=dev, dtype=torch.float32)
        part_lse = torch.empty(s.num_heads, splits, device=dev, dtype=torch.float32)
        group = s.num_heads // s.num_kv_heads
        r_qkv, r_o = _rows_per_program(qkv_n, P), _rows_per_program(s.hidden, P)
        r_gu, r_dn = _rows_per_program(s.intermediate, P), _rows_per_program(s.hidden, P)
        constants = dict(
            H=s.hidden, BH=_block(s.hidden), NQ=s.num_heads, NKV=s.num_kv_heads, D=s.head_dim,
            INTER=s.intermediate, BI=_block(s.intermediate), BA=_block(s.num_heads * s.head_dim),
            R_QKV=r_qkv, BR_QKV=_block(r_qkv), R_O=r_o, BR_O=_block(r_o), R_GU=r_gu, BR_GU=_block(r_gu),
            R_DN=r_dn, BR_DN=_block(r_dn), SPLITS=splits, SPLITS_PAD=_block(splits), GROUP=group,
            GROUP_PAD=_block(group), PAGE=self.page_size, BKV=self.config.kv_tile, HAS_QK_NORM=self.has_qk_norm,
            LANES=32 * self.config.num_warps, num_warps=self.config.num_warps)
        args = (x, positions, slot_mapping, seqlens_k, block_table, cos, sin, self.table, self.base,
                res_m, res_a, x_down, x_o, qkv, attn, act, part_out, part_lse, self.tickets, self.barrier)
        scalars = (cos.stride(0), *self.cache_strides, self.eps, self.qk_eps, self.scale * LOG2E)
        if phases or dev.type != "cuda":
            for layer in range(self.num_layers):
                for phase in range(PHASES):
                    _decode_stack_kernel[(P,)](*args, self.num_layers, layer, *scalars, PHASE=phase, L2_AHEAD=False,
                                               SPIN_LOAD=False,
                                               **constants)
        else:
            _decode_stack_kernel[(P,)](*args, self.num_layers, 0, *scalars, PHASE=-1, L2_AHEAD=self.config.l2_ahead,
                                       SPIN_LOAD=self.config.spin_load,
                                       launch_cooperative_grid=True, **constants)
        return x_down, res_a
