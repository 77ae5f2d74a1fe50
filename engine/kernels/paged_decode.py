"""Decode attention (one query token per sequence) over a paged KV cache, split-KV style.

Every program reads one contiguous range of a sequence's KV positions for all query heads of one KV
head (packed as rows of one tl.dot) and leaves the output, or a partial output with its log-sum-exp
that a second kernel merges. The grid is (KV head, sequence, split), num_splits ranges per sequence,
the sequences' programs started longest first where an order is given.

CUDA-graph safe: grids and scratch sizes come from Python ints (batch, max_seqlen_k), and ranges are
derived from the lengths on the device, so one captured launch is correct for any lengths.

Under a sliding window the splits share the window's positions (from the tile of its first key) instead of
the whole context, and the keys before the window are masked; attention-logit soft-capping caps each score.
Attention sinks (a logit per query head in the softmax's denominator, with no value) join where the splits'
partials are merged (or the one split's output is written).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from engine.kernels.common import num_sms
from engine.kernels.launch import launch_dependents, pdl_options, wait_for_previous
from engine.kernels.paged_tiles import (check_paged_inputs, check_sinks, group_pad, kv_tile_offsets, mma,
                                       page_tile_offsets, query_for_cache, score_scales, scores_log2, sink_share,
                                       upcast_dot, window_start)

MAX_GRID_SEQS = 65535  # the grid's sequence axis is its second (CUDA caps it there)


@dataclass(frozen=True)
class DecodeConfig:
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 3
    # split sequences until about this many programs an SM: 8, 16, 32 within 3% of 4 (H200, batches 32-256, db83747)
    grid_programs_per_sm: int = 4
    # the fused decode kernel's K/V loop after the GEMV (one or two rows: engine/kernels/fused_decode.py);
    # num_stages holds elsewhere. 1: the batch-1 decode graph measured 1.6-1.8% faster than with 3, batch 2
    # the same (H100, d6f80e3)
    stages_after_gemv: int = 1


@triton.jit
def _attend_tile(q, k_cache_ptr, v_cache_ptr, offs, mask, visible, qk_scale, softcap, m_i, l_i, acc,
                 SOFTCAP: tl.constexpr, UPCAST: tl.constexpr):
    """One tile of attend_range's online softmax: (m_i, l_i, acc) after the positions at offs (visible: those
    of them the query sees)."""
    k = tl.load(k_cache_ptr + offs, mask=mask, other=0.0).to(q.dtype)  # an fp8 cache widens here (to fp16)
    s = scores_log2(mma(q, tl.trans(k), UPCAST), qk_scale, softcap, SOFTCAP)
    s = tl.where(visible[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(v_cache_ptr + offs, mask=mask, other=0.0).to(q.dtype)
    acc = acc * alpha[:, None] + mma(p.to(q.dtype), v, UPCAST)
    return m_new, l_i, acc


@triton.jit
def attend_range(q, k_cache_ptr, v_cache_ptr, block_table_row, head_offset, offs_d, start, end, first_key,
                 qk_scale, softcap, stride_page, stride_slot, first_page, GROUP_PAD: tl.constexpr,
                 HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                 UPCAST: tl.constexpr, FIRST_PAGE: tl.constexpr, SLIDING: tl.constexpr, SOFTCAP: tl.constexpr):
    """Online softmax of q [GROUP_PAD, BLOCK_D] over KV positions start..end-1 (start a multiple of
    BLOCK_N), with SLIDING those from first_key on only: the normalised output, and its log2-domain
    log-sum-exp (-inf where there are no keys). FIRST_PAGE: first_page is the page of the first tile, read by
    the caller (early, off the chain of dependent loads); pages then hold whole tiles and BLOCK_D is
    HEAD_DIM. qk_scale, softcap: as paged_tiles.score_scales gives them."""
    m_i = tl.full([GROUP_PAD], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([GROUP_PAD, BLOCK_D], dtype=tl.float32)
    q = query_for_cache(q, k_cache_ptr.dtype.element_ty)
    loop_start = start
    if FIRST_PAGE:
        tl.static_assert(PAGE_SIZE % BLOCK_N == 0 and BLOCK_D == HEAD_DIM)
        offs, valid_n = page_tile_offsets(first_page, start, end, head_offset, offs_d, stride_page, stride_slot,
                                          PAGE_SIZE, BLOCK_N)
        visible = valid_n
        if SLIDING:
            visible = visible & (start + tl.arange(0, BLOCK_N) >= first_key)
        m_i, l_i, acc = _attend_tile(q, k_cache_ptr, v_cache_ptr, offs, valid_n[:, None], visible, qk_scale,
                                     softcap, m_i, l_i, acc, SOFTCAP, UPCAST)
        loop_start = start + BLOCK_N
    for n0 in range(loop_start, end, BLOCK_N):
        offs, mask, valid_n = kv_tile_offsets(block_table_row, n0, end, head_offset, offs_d,
                                              stride_page, stride_slot, PAGE_SIZE, BLOCK_N,
                                              HEAD_DIM, BLOCK_D, True)
        visible = valid_n
        if SLIDING:
            visible = visible & (n0 + tl.arange(0, BLOCK_N) >= first_key)
        m_i, l_i, acc = _attend_tile(q, k_cache_ptr, v_cache_ptr, offs, mask, visible, qk_scale, softcap,
                                     m_i, l_i, acc, SOFTCAP, UPCAST)
    has_keys = l_i > 0.0  # false for an empty range or a zero-length padding sequence
    out = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
    return out, lse


@triton.jit
def grid_program(order_ptr, ORDERED: tl.constexpr):
    """(KV head, sequence, split) of this program. The KV head varies fastest, then the
    sequence: programs start in that order, so with ORDERED (order_ptr: the sequences by decreasing
    length) the longest ranges start first and the shortest fill the tail."""
    seq = tl.program_id(1)
    if ORDERED:
        seq = tl.load(order_ptr + seq).to(tl.int32)
    return tl.program_id(0), seq, tl.program_id(2)


@triton.jit
def split_range(seqlen, first_key, split, num_splits, BLOCK_N: tl.constexpr):
    """(positions per split, whole KV tiles; start, end) of one split of the positions a sequence's last query
    sees, first_key..seqlen-1, counted from the KV tile that holds first_key."""
    first_tile = (first_key // BLOCK_N) * BLOCK_N
    per_split = tl.cdiv(tl.cdiv(seqlen - first_tile, num_splits), BLOCK_N) * BLOCK_N
    start = first_tile + split * per_split
    return per_split, start, tl.minimum(start + per_split, seqlen)


@triton.jit
def _decode_split_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, seqlens_k_ptr, block_tables_ptr, cu_seqlens_q_ptr,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_page, stride_slot, stride_khead, stride_bt,
    qk_scale, softcap, window, num_heads, part_out_ptr, part_lse_ptr, num_splits, order_ptr, sinks_ptr,
    DIRECT: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr, MIXED: tl.constexpr, ORDERED: tl.constexpr, SLIDING: tl.constexpr,
    SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr, PDL: tl.constexpr,
):
    launch_dependents(PDL)
    wait_for_previous(PDL)
    kv_head, seq, split = grid_program(order_ptr, ORDERED)
    token = seq
    if MIXED:  # a varlen batch: act only on its one-token sequences, the prefill kernel does the rest
        token = tl.load(cu_seqlens_q_ptr + seq)
        if tl.load(cu_seqlens_q_ptr + seq + 1) - token != 1:
            return
    seqlen = tl.load(seqlens_k_ptr + seq)
    first_key = window_start(seqlen, window, SLIDING)
    per_split, start, end = split_range(seqlen, first_key, split, num_splits, BLOCK_N)

    offs_g = tl.arange(0, GROUP_PAD)
    head = kv_head * GROUP + offs_g
    g_mask = offs_g < GROUP
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    q = tl.load(q_ptr + token.to(tl.int64) * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    out, lse = attend_range(q, k_cache_ptr, v_cache_ptr, block_tables_ptr + seq.to(tl.int64) * stride_bt,
                            kv_head * stride_khead, offs_d, start, end, first_key, qk_scale, softcap, stride_page,
                            stride_slot, 0, GROUP_PAD, HEAD_DIM, BLOCK_D, PAGE_SIZE, BLOCK_N, UPCAST, False,
                            SLIDING, SOFTCAP)
    if DIRECT:
        if HAS_SINKS:
            out = out * sink_share(lse, sinks_ptr, head, g_mask)[:, None]
        o_ptrs = out_ptr + token.to(tl.int64) * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :])
    else:
        # scratch layout: part_out [B, H, num_splits, BLOCK_D], part_lse [B, H, num_splits] (log2 domain)
        row = (seq.to(tl.int64) * num_heads + head) * num_splits + split
        tl.store(part_out_ptr + row[:, None] * BLOCK_D + offs_d[None, :], out, mask=g_mask[:, None])
        tl.store(part_lse_ptr + row, lse, mask=g_mask)


@triton.jit
def _decode_merge_kernel(
    part_out_ptr, part_lse_ptr, out_ptr, cu_seqlens_q_ptr,
    stride_ot, stride_oh, num_heads, num_splits, sinks_ptr,
    TILE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, MIXED: tl.constexpr,
    HAS_SINKS: tl.constexpr, PDL: tl.constexpr,
):
    """Merge one (sequence, head)'s partial outputs, at [seq, head, 0..num_splits-1], by their
    log-sum-exp, TILE partials at a time; with HAS_SINKS the head's sink joins their denominator."""
    launch_dependents(PDL)
    wait_for_previous(PDL)
    seq = tl.program_id(0)
    head = tl.program_id(1)
    token = seq
    if MIXED:
        token = tl.load(cu_seqlens_q_ptr + seq)
        if tl.load(cu_seqlens_q_ptr + seq + 1) - token != 1:
            return
    count = num_splits
    row0 = (seq.to(tl.int64) * num_heads + head) * num_splits
    row_step = 1
    offs_t = tl.arange(0, TILE)
    offs_d = tl.arange(0, BLOCK_D)
    m = tl.full([], -1.0e30, dtype=tl.float32)  # finite: a padding sequence's partials are all -inf
    total = tl.zeros([], dtype=tl.float32)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for t0 in range(0, count, TILE):
        t_mask = t0 + offs_t < count
        rows = row0 + (t0 + offs_t) * row_step
        lse = tl.load(part_lse_ptr + rows, mask=t_mask, other=float("-inf"))
        parts = tl.load(part_out_ptr + rows[:, None] * BLOCK_D + offs_d[None, :], mask=t_mask[:, None], other=0.0)
        m_new = tl.maximum(m, tl.max(lse, 0))
        alpha = tl.exp2(m - m_new)
        weight = tl.exp2(lse - m_new)
        total = total * alpha + tl.sum(weight, 0)
        acc = acc * alpha + tl.sum(parts * weight[:, None], 0)
        m = m_new
    out = acc / tl.where(total > 0.0, total, 1.0)
    if HAS_SINKS:
        lse = tl.where(total > 0.0, m + tl.log2(tl.where(total > 0.0, total, 1.0)), float("-inf"))
        out = out * sink_share(lse, sinks_ptr, head, True)
    tl.store(out_ptr + token.to(tl.int64) * stride_ot + head * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty),
             mask=offs_d < HEAD_DIM)


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_seqlen_k: int, block_n: int,
                      num_sms: int, programs_per_sm: int = 4) -> int:
    """Enough programs for about `programs_per_sm` per SM (one program streams its range
    serially, so an SM needs several in flight to keep memory busy, and short ranges shorten the tail
    that unequal lengths leave), each split at least two KV tiles long. max_seqlen_k: the most positions a
    sequence's query sees (attended_length)."""
    programs = num_seqs * num_kv_heads
    if programs >= programs_per_sm * num_sms:
        return 1
    wanted = triton.cdiv(programs_per_sm * num_sms, programs)
    longest = max(1, triton.cdiv(max_seqlen_k, 2 * block_n))
    return max(1, min(wanted, longest, 64))


def attended_length(max_seqlen_k: int, window: int, block_n: int) -> int:
    """The most KV positions a split-KV launch walks for one sequence: its context, or under a sliding window
    the window's positions from the KV tile of its first key."""
    return min(max_seqlen_k, window + block_n - 1) if window > 0 else max_seqlen_k


def decode_order(seqlens_k: torch.Tensor) -> torch.Tensor:
    """The sequences by decreasing length (on the device, no host sync; CUDA-graph safe)."""
    return torch.argsort(seqlens_k, descending=True).to(torch.int32)


CUDA_DECODE_CONFIG = DecodeConfig()
CPU_DECODE_CONFIG = DecodeConfig(block_n=16, num_warps=4, num_stages=1)


def default_decode_config(t: torch.Tensor) -> DecodeConfig:
    """The decode kernels' tiles and split sizing for tensors on t's device."""
    return CUDA_DECODE_CONFIG if t.device.type == "cuda" else CPU_DECODE_CONFIG


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 seqlens_k: torch.Tensor, block_tables: torch.Tensor, max_seqlen_k: int,
                 scale: float, out: torch.Tensor | None = None, num_splits: int | None = None,
                 config: DecodeConfig | None = None, cu_seqlens_q: torch.Tensor | None = None,
                 order: torch.Tensor | None = None, window: int = 0, softcap: float = 0.0,
                 sinks: torch.Tensor | None = None) -> torch.Tensor:
    """One query token per sequence (q: [B, H, D]) over its paged context of seqlens_k[b] positions.

    With cu_seqlens_q, q is a varlen batch: only its one-token sequences are computed (into their
    rows of `out`), the rest are left for paged_prefill(..., skip_decodes=True). num_splits: ranges
    per sequence (default: choose_num_splits). `order`: a permutation of the B sequences, the order
    their programs start in; decode_order(seqlens_k) puts the longest first, so unequal lengths leave
    a shorter tail. The results do not depend on it. window: a sliding window (the query at position
    seqlens_k[b] - 1 sees keys from seqlens_k[b] - window on), 0 for none. softcap: attention-logit
    soft-capping (cap x tanh(score / cap)), 0 for none. sinks: [H] attention sinks (paged_prefill's), None for none.
    """
    num_heads, num_kv_heads, group = check_paged_inputs(q, k_cache, v_cache)
    check_sinks(sinks, num_heads)
    num_seqs, head_dim = seqlens_k.shape[0], q.shape[2]
    mixed = cu_seqlens_q is not None
    assert mixed or q.shape[0] == num_seqs, "decode needs one query token per sequence"
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if num_seqs == 0:
        return out
    config = config or default_decode_config(q)
    block_d = max(16, triton.next_power_of_2(head_dim))
    cu_seqlens_q = cu_seqlens_q if mixed else seqlens_k  # a placeholder pointer when not mixed
    if order is not None:
        assert order.shape == (num_seqs,) and order.device == q.device, "order: one index per sequence"
    if num_seqs > MAX_GRID_SEQS:
        raise ValueError(f"decode batches of at most {MAX_GRID_SEQS} sequences, got {num_seqs}")
    if num_splits is None:
        attended = attended_length(max_seqlen_k, window, config.block_n)
        num_splits = choose_num_splits(num_seqs, num_kv_heads, attended, config.block_n, num_sms(q.device),
                                       config.grid_programs_per_sm)
    shape = (num_seqs, num_heads, num_splits)
    part_out = torch.empty(*shape, block_d, dtype=torch.float32, device=q.device) if num_splits > 1 else out
    part_lse = torch.empty(shape, dtype=torch.float32, device=q.device) if num_splits > 1 else out
    _decode_split_kernel[(num_kv_heads, num_seqs, num_splits)](
        q, k_cache, v_cache, out, seqlens_k, block_tables, cu_seqlens_q,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        *score_scales(scale, softcap), window, num_heads, part_out, part_lse, num_splits,
        seqlens_k if order is None else order, q if sinks is None else sinks,
        DIRECT=num_splits == 1, GROUP=group, GROUP_PAD=max(16, group_pad(group)), HEAD_DIM=head_dim,
        BLOCK_D=block_d, PAGE_SIZE=k_cache.shape[1], BLOCK_N=config.block_n, UPCAST=upcast_dot(q), MIXED=mixed,
        ORDERED=order is not None, SLIDING=window > 0, SOFTCAP=softcap > 0, HAS_SINKS=sinks is not None,
        num_warps=config.num_warps,
        num_stages=config.num_stages, **pdl_options(q))
    if num_splits == 1:
        return out
    _decode_merge_kernel[(num_seqs, num_heads)](
        part_out, part_lse, out, cu_seqlens_q, out.stride(0), out.stride(1), num_heads, num_splits,
        out if sinks is None else sinks, TILE=triton.next_power_of_2(num_splits), HEAD_DIM=head_dim,
        BLOCK_D=block_d, MIXED=mixed, HAS_SINKS=sinks is not None, num_warps=4,
        **pdl_options(q))
    return out
