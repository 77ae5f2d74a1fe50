"""Decode attention straight from the packed qkv projection: one kernel where there were three.

The split-KV decode kernel (paged_decode.py) with the work of the kernels on either side
of it folded in:

- before: qkv preparation (qkv_prep.py). Each program normalises and rotates its KV head's query heads
  itself, with qkv_prep's code, so the queries are the same bits. The program whose range holds the new
  token (the sequence's last position) normalises, rotates and stores that token's K and V, then
  synchronises its threads before reading the cache, which then holds them.
- after: the merge of the partial outputs. Every program of a (sequence, KV head) writes its partial
  and takes a ticket from a counter; the one that takes the last ticket merges the partials of that
  KV head's query heads (the merge kernel's arithmetic) and resets the counter for the next launch.

So a layer's decode attention is one launch in the chain of kernels that a batch-1 step waits on,
instead of three. Prefill and mixed batches keep the separate kernels. A sliding window, attention-logit
soft-capping and attention sinks are paged_decode's.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels import gemv
from engine.kernels.common import num_sms, round_to
from engine.kernels.launch import launch_dependents, pdl_options, wait_for_previous
from engine.kernels.paged_decode import (MAX_GRID_SEQS, DecodeConfig, attend_range, attended_length,
                                         choose_num_splits, default_decode_config, grid_program, split_range)
from engine.kernels.paged_tiles import (check_paged_inputs, check_sinks, group_pad, prefetch_page_tile,
                                       score_scales, sink_share, to_cache, upcast_dot, window_start)
from engine.kernels.qkv_prep import norm_rope

# float32 partial values the merging program loads at once: 8,192 is the two query heads of a Qwen3-0.6B KV
# head over 32 splits, 64 registers a thread at 4 warps
MERGE_VALUES = 8192


@triton.jit
def _fused_decode_kernel(
    qkv_ptr, positions_ptr, slot_mapping_ptr, cos_ptr, sin_ptr, q_weight_ptr, k_weight_ptr,
    k_cache_ptr, v_cache_ptr, out_ptr, seqlens_k_ptr, block_tables_ptr,
    part_out_ptr, part_lse_ptr, counters_ptr, order_ptr, sinks_ptr,
    stride_t, stride_cos, stride_ot, stride_oh, stride_page, stride_slot, stride_khead, stride_bt,
    qk_scale, softcap, window, eps, num_heads, num_kv_heads, num_splits,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, HALF: tl.constexpr,
    PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, SPLITS_PAD: tl.constexpr,
    UPCAST: tl.constexpr, HAS_NORM: tl.constexpr, UNIT_OFFSET: tl.constexpr, SLIDING: tl.constexpr,
    SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr, ORDERED: tl.constexpr, PDL: tl.constexpr,
    EARLY: tl.constexpr, EARLY_PAGE: tl.constexpr, PREFETCH: tl.constexpr, MERGE_HEADS: tl.constexpr,
    SKIP_EMPTY: tl.constexpr,
):
    launch_dependents(PDL)
    if not EARLY:
        wait_for_previous(PDL)
    # With EARLY, read before the wait what no kernel of the step writes (its inputs, copied before its
    # first kernel; the rotary tables): off the chain that starts when the qkv projection completes.
    kv_head, seq, split = grid_program(order_ptr, ORDERED)
    seqlen = tl.load(seqlens_k_ptr + seq)
    first_key = window_start(seqlen, window, SLIDING)
    first_tile = (first_key // BLOCK_N) * BLOCK_N
    per_split, start, end = split_range(seqlen, first_key, split, num_splits, BLOCK_N)
    dtype = out_ptr.dtype.element_ty
    pos = tl.load(positions_ptr + seq)
    offs_half = tl.arange(0, HALF)
    all_half = offs_half < HALF
    cos = round_to(tl.load(cos_ptr + pos * stride_cos + offs_half), dtype)
    sin = round_to(tl.load(sin_ptr + pos * stride_cos + offs_half), dtype)
    slot = tl.load(slot_mapping_ptr + seq).to(tl.int64)
    block_table_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    first_page = 0
    if EARLY_PAGE:  # the range's first page (an input too), so the first tile's loads need nothing after the wait
        first_page = tl.load(block_table_row + start // PAGE_SIZE, mask=start < end, other=0).to(tl.int64)
        if PREFETCH and start < end:  # and that tile queued into L2, so its loads after the wait stay on chip
            prefetch_page_tile(k_cache_ptr, v_cache_ptr, first_page, start, end, kv_head * stride_khead,
                               stride_page, stride_slot, PAGE_SIZE, BLOCK_N, HEAD_DIM)
    if EARLY:
        wait_for_previous(PDL)

    # the queries of this KV head, normed and rotated as qkv_prep does, halves joined into [GROUP_PAD, D]
    row = qkv_ptr + seq.to(tl.int64) * stride_t
    offs_g = tl.arange(0, GROUP_PAD)
    g_mask = offs_g < GROUP
    head = kv_head * GROUP + offs_g
    q_lo = row + head[:, None] * HEAD_DIM + offs_half[None, :]
    q1 = tl.load(q_lo, mask=g_mask[:, None], other=0.0).to(tl.float32)
    q2 = tl.load(q_lo + HALF, mask=g_mask[:, None], other=0.0).to(tl.float32)
    # The new token's K and V, for the program whose range holds the sequence's last position (slot -1: a
    # CUDA graph's padding row), read beside the queries: that program's chain, the longest of its KV head,
    # then waits for one round trip to L2, not two.
    holds_new = (split == (seqlen - 1 - first_tile) // tl.maximum(per_split, 1)) & (slot >= 0)
    new_mask = offs_half[None, :] < tl.where(holds_new, HALF, 0)  # all of the row, or none of it
    k_lo = row + (num_heads + kv_head) * HEAD_DIM + offs_half[None, :]
    v_lo = k_lo + num_kv_heads * HEAD_DIM
    k1 = tl.load(k_lo, mask=new_mask, other=0.0).to(tl.float32)
    k2 = tl.load(k_lo + HALF, mask=new_mask, other=0.0).to(tl.float32)
    v1 = tl.load(v_lo, mask=new_mask, other=0.0)
    v2 = tl.load(v_lo + HALF, mask=new_mask, other=0.0)
    q1, q2 = norm_rope(q1, q2, q_weight_ptr, cos, sin, offs_half, all_half, eps, HEAD_DIM, HAS_NORM, UNIT_OFFSET,
                       HALF, dtype)
    q = tl.reshape(tl.permute(tl.join(q1.to(dtype), q2.to(dtype)), (0, 2, 1)), (GROUP_PAD, HEAD_DIM))

    if holds_new:  # normed and rotated as qkv_prep does, then stored
        k1, k2 = norm_rope(k1, k2, k_weight_ptr, cos, sin, offs_half, all_half, eps, HEAD_DIM, HAS_NORM,
                           UNIT_OFFSET, HALF, dtype)
        dst = (slot // PAGE_SIZE) * stride_page + (slot % PAGE_SIZE) * stride_slot + kv_head * stride_khead \
            + offs_half[None, :]
        cache_dtype = k_cache_ptr.dtype.element_ty  # the model's dtype, or fp8 (rounded from it)
        tl.store(k_cache_ptr + dst, to_cache(k1.to(dtype), cache_dtype))
        tl.store(k_cache_ptr + dst + HALF, to_cache(k2.to(dtype), cache_dtype))
        tl.store(v_cache_ptr + dst, to_cache(v1, cache_dtype))
        tl.store(v_cache_ptr + dst + HALF, to_cache(v2, cache_dtype))
    tl.debug_barrier()  # the program's own stores are visible to all its threads' cache reads below

    offs_d = tl.arange(0, HEAD_DIM)
    out, lse = attend_range(q, k_cache_ptr, v_cache_ptr, block_table_row, kv_head * stride_khead, offs_d, start,
                            end, first_key, qk_scale, softcap, stride_page, stride_slot, first_page, GROUP_PAD,
                            HEAD_DIM, HEAD_DIM, PAGE_SIZE, BLOCK_N, UPCAST, EARLY_PAGE, SLIDING, SOFTCAP)
    if SPLITS_PAD == 1:
        if HAS_SINKS:
            out = out * sink_share(lse, sinks_ptr, head, g_mask)[:, None]
        o_ptrs = out_ptr + seq.to(tl.int64) * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, out.to(dtype), mask=g_mask[:, None])
    else:
        # The merge reads the partials of the splits that hold positions (the first `used`; a padding row's
        # first); the others' would weigh 0. With SKIP_EMPTY only those splits write a partial and take a
        # ticket: at one sequence the empty ones' tickets queued on the same counter before the last one.
        used = tl.minimum(tl.cdiv(tl.maximum(seqlen - first_tile, 1), tl.maximum(per_split, 1)), num_splits)
        takers = num_splits
        if SKIP_EMPTY:
            takers = used
        if split < takers:
            # partials [B, H, num_splits, D] and their log-sum-exps [B, H, num_splits] (log2 domain)
            prow = (seq.to(tl.int64) * num_heads + head) * num_splits + split
            tl.store(part_out_ptr + prow[:, None] * HEAD_DIM + offs_d[None, :], out, mask=g_mask[:, None])
            tl.store(part_lse_ptr + prow, lse, mask=g_mask)
            tl.debug_barrier()  # every thread's partial stored before the ticket releases them
            counter = counters_ptr + seq * num_kv_heads + kv_head
            ticket = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
            if ticket == takers - 1:
                tl.store(counter, 0)
                _merge_group(part_out_ptr, part_lse_ptr, out_ptr, sinks_ptr, seq, kv_head, num_heads, num_splits,
                             used, stride_ot, stride_oh, GROUP, HEAD_DIM, SPLITS_PAD, MERGE_HEADS, HAS_SINKS)


@triton.jit
def _merge_group(part_out_ptr, part_lse_ptr, out_ptr, sinks_ptr, seq, kv_head, num_heads, num_splits, used,
                 stride_ot, stride_oh, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, SPLITS_PAD: tl.constexpr,
                 MERGE_HEADS: tl.constexpr, HAS_SINKS: tl.constexpr):
    """The merge kernel's arithmetic for the GROUP query heads of one KV head, over the partials of the
    first `used` splits, read from L2 (.cg), where the other programs' released stores are. MERGE_HEADS
    heads' partials are loaded as one tile: one round trip to L2 for them, where a head at a time waits for
    the head before's store (the loads may not pass it)."""
    offs_t = tl.arange(0, SPLITS_PAD)
    t_mask = offs_t < used
    offs_d = tl.arange(0, HEAD_DIM)
    offs_g = tl.arange(0, MERGE_HEADS)
    for g0 in tl.static_range(0, GROUP, MERGE_HEADS):
        g_mask = g0 + offs_g < GROUP
        head = kv_head * GROUP + g0 + offs_g
        rows = (seq.to(tl.int64) * num_heads + head)[:, None] * num_splits + offs_t[None, :]
        mask = g_mask[:, None] & t_mask[None, :]
        lse = tl.load(part_lse_ptr + rows, mask=mask, other=float("-inf"), cache_modifier=".cg")
        parts = tl.load(part_out_ptr + rows[:, :, None] * HEAD_DIM + offs_d[None, None, :], mask=mask[:, :, None],
                        other=0.0, cache_modifier=".cg")
        m = tl.maximum(-1.0e30, tl.max(lse, 1))  # finite: a padding sequence's partials are all -inf
        weight = tl.exp2(lse - m[:, None])
        total = tl.sum(weight, 1)
        acc = tl.sum(parts * weight[:, :, None], 1)
        out = acc / tl.where(total > 0.0, total, 1.0)[:, None]
        if HAS_SINKS:  # each head's sink joins the merged denominator
            lse_all = tl.where(total > 0.0, m + tl.log2(tl.where(total > 0.0, total, 1.0)), float("-inf"))
            out = out * sink_share(lse_all, sinks_ptr, head, g_mask)[:, None]
        tl.store(out_ptr + seq.to(tl.int64) * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=g_mask[:, None])


def fits(head_dim: int) -> bool:
    """Whether fused_decode takes this head size (a power of two from 16: the joined query halves)."""
    return head_dim >= 16 and head_dim & (head_dim - 1) == 0


def fused_decode(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 q_weight: torch.Tensor | None, k_weight: torch.Tensor | None, eps: float,
                 k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                 seqlens_k: torch.Tensor, block_tables: torch.Tensor, max_seqlen_k: int, scale: float,
                 num_heads: int, num_kv_heads: int, counters: torch.Tensor, order: torch.Tensor | None = None,
                 num_splits: int | None = None, config: DecodeConfig | None = None,
                 after_gemv: bool | None = None, window: int = 0, softcap: float = 0.0,
                 unit_offset: bool = False, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention output [B, H, D] of one new token per sequence, from its qkv row [B, (H + 2 Hkv) D]:
    what qkv_prep followed by paged_decode computes, K/V stored the same way.

    counters: int32 zeros, at least B x Hkv of them, left zero again; one set per stream of launches
    (the caller keeps it). Other arguments as in qkv_prep and paged_decode.

    after_gemv: whether the engine's GEMV computed qkv (it lets this kernel start early, and the kernel
    then reads its inputs before its wait); None: taken to be so for up to gemv.MAX_ROWS rows.
    window, softcap, sinks: as paged_decode's; unit_offset: as qkv_prep's.
    """
    head_dim = k_cache.shape[3]
    if not fits(head_dim):
        raise ValueError(f"fused decode needs a power-of-two head_dim >= 16, got {head_dim}")
    num_seqs = qkv.shape[0]
    assert qkv.shape[1] == (num_heads + 2 * num_kv_heads) * head_dim and qkv.stride(1) == 1
    assert cos.shape == sin.shape and cos.stride(1) == 1 and sin.stride() == cos.stride()
    assert positions.shape == slot_mapping.shape == seqlens_k.shape == (num_seqs,)
    assert (q_weight is None) == (k_weight is None)
    out = torch.empty(num_seqs, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    heads, kv_heads, group = check_paged_inputs(out, k_cache, v_cache)
    assert (heads, kv_heads) == (num_heads, num_kv_heads)
    check_sinks(sinks, num_heads)
    if num_seqs == 0:
        return out
    if num_seqs > MAX_GRID_SEQS:
        raise ValueError(f"decode batches of at most {MAX_GRID_SEQS} sequences, got {num_seqs}")
    assert counters.dtype == torch.int32 and counters.numel() >= num_seqs * num_kv_heads
    config = config or default_decode_config(qkv)
    if num_splits is None:
        attended = attended_length(max_seqlen_k, window, config.block_n)
        num_splits = choose_num_splits(num_seqs, num_kv_heads, attended, config.block_n, num_sms(qkv.device),
                                       config.grid_programs_per_sm)
    # early reads where the qkv projection is the GEMV, whose programs let this kernel start before it
    # completes (-0.024 ms a batch-1 step); after cuBLAS they gained nothing and cost 0.4-0.7% at 16-64 rows
    early = num_seqs <= gemv.MAX_ROWS if after_gemv is None else after_gemv
    if num_splits > 1:
        part_out = torch.empty(num_seqs, num_heads, num_splits, head_dim, dtype=torch.float32, device=qkv.device)
        part_lse = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32, device=qkv.device)
    else:
        part_out = part_lse = out  # unused
    has_norm = q_weight is not None
    if order is not None:
        assert order.shape == (num_seqs,) and order.device == qkv.device, "order: one index per sequence"
    page_early = early_page_applies(early, num_seqs, k_cache, config)
    _fused_decode_kernel[(num_kv_heads, num_seqs, num_splits)](
        qkv, positions, slot_mapping, cos, sin, q_weight if has_norm else cos, k_weight if has_norm else cos,
        k_cache, v_cache, out, seqlens_k, block_tables, part_out, part_lse, counters,
        seqlens_k if order is None else order, cos if sinks is None else sinks,
        qkv.stride(0), cos.stride(0), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        *score_scales(scale, softcap), window, eps, num_heads, num_kv_heads, num_splits,
        GROUP=group, GROUP_PAD=max(16, group_pad(group)), HEAD_DIM=head_dim, HALF=head_dim // 2,
        PAGE_SIZE=k_cache.shape[1], BLOCK_N=config.block_n, SPLITS_PAD=triton.next_power_of_2(num_splits),
        UPCAST=upcast_dot(qkv), HAS_NORM=has_norm, UNIT_OFFSET=unit_offset, SLIDING=window > 0, SOFTCAP=softcap > 0,
        HAS_SINKS=sinks is not None, ORDERED=order is not None,
        EARLY=early, EARLY_PAGE=page_early, PREFETCH=page_early and prefetch_applies(qkv),
        MERGE_HEADS=merge_heads(group, triton.next_power_of_2(num_splits), head_dim), SKIP_EMPTY=num_seqs == 1,
        num_warps=config.num_warps, num_stages=loop_stages(config, early),
        **pdl_options(qkv))
    return out


def merge_heads(group: int, splits_pad: int, head_dim: int) -> int:
    """Query heads whose partials the merging program loads as one tile: all of its KV head's (a power of
    two covering them) while the tile holds at most MERGE_VALUES float32 values, halved until it does."""
    heads = triton.next_power_of_2(group)
    while heads > 1 and heads * splits_pad * head_dim > MERGE_VALUES:
        heads //= 2
    return heads


def early_page_applies(early: bool, num_seqs: int, k_cache: torch.Tensor, config: DecodeConfig) -> bool:
    """Whether a program reads its range's first page before its wait: where it reads its other inputs
    early (after the GEMV), for one sequence (the batch-1 decode graph measured 2.3-2.9% faster, two rows 2.3%
    slower; fa0c667), and pages holding whole tiles."""
    return early and num_seqs == 1 and k_cache.shape[1] % config.block_n == 0


def prefetch_applies(qkv: torch.Tensor) -> bool:
    """Whether a program that reads its first page early also queues that tile into L2 before its wait
    (the batch-1 decode graph 0.5% faster on the H100, c40fd60): on a CUDA GPU only (the interpreter has no
    prefetch instruction)."""
    return qkv.is_cuda


def loop_stages(config: DecodeConfig, early: bool) -> int:
    """Pipeline stages of the K/V loop: config.stages_after_gemv where the qkv projection is the GEMV (up to
    gemv.MAX_ROWS rows), config.num_stages elsewhere."""
    return config.stages_after_gemv if early else config.num_stages
