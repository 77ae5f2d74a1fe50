"""Attention for a varlen batch of query chunks over a paged KV cache (prefill, chunked prefill, mixed).

Grid: (sequence, query tile, KV head). A program takes BLOCK_Q query tokens of one sequence and all
query heads of one KV head, packed as BLOCK_Q * GROUP_PAD rows of one tl.dot operand, so GQA reads
each K/V tile once for the whole group and the matrix units see a tall M. It walks the sequence's
KV positions through the block table with an online softmax: first the tiles every row may see in
full (no mask), then the causal tail, where query token i of a chunk of q_len sits at position
seqlen_k - q_len + i. Under a sliding window (a query at position i sees keys j with i - j < window) the
walk starts at the tile of the first key the tile's first row sees, and the tiles the window's edge crosses
are masked too. Attention-logit soft-capping (Gemma 2) caps each score as it is computed; attention sinks
(gpt-oss: a logit per query head in the softmax's denominator, with no value) join the denominator at the end.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from engine.kernels.paged_tiles import (check_paged_inputs, check_sinks, group_pad, kv_tile_offsets, mma,
                                       query_for_cache, score_scales, scores_log2, sink_share, upcast_dot)


@dataclass(frozen=True)
class PrefillConfig:
    block_m: int = 128     # packed rows (tokens x padded group) per program
    block_n: int = 128     # KV positions per inner step
    num_warps: int = 8
    num_stages: int = 2


@triton.jit
def _attend_tile(acc, m_i, l_i, q, k_cache_ptr, v_cache_ptr, block_table_row, n0, seqlen, q_pos,
                 head_offset, offs_d, stride_page, stride_slot, qk_scale, softcap, window,
                 PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
                 BLOCK_D: tl.constexpr, MASKED: tl.constexpr, SLIDING: tl.constexpr, SOFTCAP: tl.constexpr,
                 UPCAST: tl.constexpr):
    """One KV tile of the online softmax. MASKED: the tile holds keys some row must not see (past its
    position, or with SLIDING before its window); otherwise every row sees every key of it."""
    offs, mask, valid_n = kv_tile_offsets(block_table_row, n0, seqlen, head_offset, offs_d,
                                          stride_page, stride_slot, PAGE_SIZE, BLOCK_N,
                                          HEAD_DIM, BLOCK_D, MASKED)
    if MASKED or BLOCK_D != HEAD_DIM:
        k = tl.load(k_cache_ptr + offs, mask=mask, other=0.0)
    else:
        k = tl.load(k_cache_ptr + offs)
    k = k.to(q.dtype)  # an fp8 cache widens here (to fp16)
    s = scores_log2(mma(q, tl.trans(k), UPCAST), qk_scale, softcap, SOFTCAP)
    if MASKED:
        offs_n = n0 + tl.arange(0, BLOCK_N)
        visible = (offs_n[None, :] <= q_pos[:, None]) & valid_n[None, :]
        if SLIDING:
            visible = visible & (offs_n[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if MASKED or BLOCK_D != HEAD_DIM:
        v = tl.load(v_cache_ptr + offs, mask=mask, other=0.0)
    else:
        v = tl.load(v_cache_ptr + offs)
    acc = acc * alpha[:, None] + mma(p.to(q.dtype), v.to(q.dtype), UPCAST)
    return acc, m_new, l_i


@triton.jit
def _paged_prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
    cu_seqlens_q_ptr, seqlens_k_ptr, block_tables_ptr,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_page, stride_slot, stride_khead, stride_bt,
    qk_scale, softcap, window, sinks_ptr,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_Q: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr, SKIP_DECODES: tl.constexpr, SLIDING: tl.constexpr, SOFTCAP: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    seq = tl.program_id(0)
    q_tile = tl.program_id(1)
    kv_head = tl.program_id(2)
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    if q_tile * BLOCK_Q >= q_len:
        return
    if SKIP_DECODES and q_len == 1:
        return  # paged_decode(..., cu_seqlens_q=...) computes the one-token sequences
    seqlen = tl.load(seqlens_k_ptr + seq)
    first_q_pos = seqlen - q_len  # cache position of the chunk's first query token

    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_PAD
    offs_m = tl.arange(0, BLOCK_M)
    token = q_tile * BLOCK_Q + offs_m // GROUP_PAD
    head = kv_head * GROUP + offs_m % GROUP_PAD
    row_mask = (token < q_len) & (offs_m % GROUP_PAD < GROUP)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    q_rows = (q_start + token).to(tl.int64) * stride_qt + head * stride_qh
    q = tl.load(q_ptr + q_rows[:, None] + offs_d[None, :],
                mask=row_mask[:, None] & d_mask[None, :], other=0.0)
    q = query_for_cache(q, k_cache_ptr.dtype.element_ty)
    q_pos = first_q_pos + token

    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)  # finite: a fully masked tile gives p=0, not NaN
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    block_table_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    head_offset = kv_head * stride_khead
    tile_first_pos = first_q_pos + q_tile * BLOCK_Q
    tile_last_pos = first_q_pos + tl.minimum((q_tile + 1) * BLOCK_Q, q_len) - 1
    full_end = ((tile_first_pos + 1) // BLOCK_N) * BLOCK_N  # KV tiles every row sees in full end here...
    full_start = 0
    if SLIDING:
        # ...and start at the first tile inside the last row's window (none, where the window is narrower than
        # the query tile); before it, from the tile of the first key the first row sees, the window's edge
        full_start = tl.minimum(tl.cdiv(tl.maximum(tile_last_pos - window + 1, 0), BLOCK_N) * BLOCK_N, full_end)
        head_start = (tl.maximum(tile_first_pos - window + 1, 0) // BLOCK_N) * BLOCK_N
    for n0 in range(full_start, full_end, BLOCK_N):
        acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q, k_cache_ptr, v_cache_ptr, block_table_row, n0,
                                     seqlen, q_pos, head_offset, offs_d, stride_page, stride_slot,
                                     qk_scale, softcap, window, PAGE_SIZE, BLOCK_N, HEAD_DIM, BLOCK_D, False,
                                     SLIDING, SOFTCAP, UPCAST)
    if SLIDING:  # the masked tiles, the window's edge then the causal tail, in one loop (one copy of its body)
        edge_tiles = (full_start - head_start) // BLOCK_N
        for i in range(0, edge_tiles + tl.cdiv(tile_last_pos + 1 - full_end, BLOCK_N)):
            n0 = tl.where(i < edge_tiles, head_start + i * BLOCK_N, full_end + (i - edge_tiles) * BLOCK_N)
            acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q, k_cache_ptr, v_cache_ptr, block_table_row, n0,
                                         seqlen, q_pos, head_offset, offs_d, stride_page, stride_slot,
                                         qk_scale, softcap, window, PAGE_SIZE, BLOCK_N, HEAD_DIM, BLOCK_D, True,
                                         SLIDING, SOFTCAP, UPCAST)
    else:
        for n0 in range(full_end, tile_last_pos + 1, BLOCK_N):
            acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q, k_cache_ptr, v_cache_ptr, block_table_row, n0,
                                         seqlen, q_pos, head_offset, offs_d, stride_page, stride_slot,
                                         qk_scale, softcap, window, PAGE_SIZE, BLOCK_N, HEAD_DIM, BLOCK_D, True,
                                         SLIDING, SOFTCAP, UPCAST)

    out = acc / l_i[:, None]
    if HAS_SINKS:
        out = out * sink_share(m_i + tl.log2(l_i), sinks_ptr, head, row_mask)[:, None]
    o_rows = (q_start + token).to(tl.int64) * stride_ot + head * stride_oh
    tl.store(out_ptr + o_rows[:, None] + offs_d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=row_mask[:, None] & d_mask[None, :])


def default_prefill_config(q: torch.Tensor) -> PrefillConfig:
    if q.device.type != "cuda":  # the Triton interpreter: small tiles keep it quick
        return PrefillConfig(block_m=32, block_n=16, num_warps=4, num_stages=1)
    if q.shape[-1] > 128:
        return PrefillConfig(block_m=64, block_n=32, num_warps=4, num_stages=2)
    return PrefillConfig()


def paged_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  cu_seqlens_q: torch.Tensor, seqlens_k: torch.Tensor, block_tables: torch.Tensor,
                  max_seqlen_q: int, scale: float, out: torch.Tensor | None = None,
                  config: PrefillConfig | None = None, skip_decodes: bool = False, window: int = 0,
                  softcap: float = 0.0, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of each sequence's query chunk over its paged context. q: [num_tokens, H, D].

    skip_decodes leaves one-token sequences alone (a tall query tile would waste its rows on them).
    window: a sliding window (a query at position i sees keys j with i - j < window), 0 for none.
    softcap: attention-logit soft-capping, each score cap x tanh(score / cap); 0 for none.
    sinks: [H] attention sinks, each head's logit (in the scaled scores' units) joined to its softmax's
    denominator; None for none.
    """
    num_heads, num_kv_heads, group = check_paged_inputs(q, k_cache, v_cache)
    check_sinks(sinks, num_heads)
    head_dim = q.shape[2]
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    num_seqs = seqlens_k.shape[0]
    if q.shape[0] == 0 or num_seqs == 0:
        return out
    config = config or default_prefill_config(q)
    gpad = group_pad(group)
    block_q = max(1, config.block_m // gpad)
    if block_q * gpad < 16:  # tl.dot needs at least 16 rows
        block_q = 16 // gpad
    grid = (num_seqs, triton.cdiv(max_seqlen_q, block_q), num_kv_heads)
    _paged_prefill_kernel[grid](
        q, k_cache, v_cache, out, cu_seqlens_q, seqlens_k, block_tables,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        *score_scales(scale, softcap), window, q if sinks is None else sinks,
        GROUP=group, GROUP_PAD=gpad, BLOCK_Q=block_q,
        HEAD_DIM=head_dim, BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        PAGE_SIZE=k_cache.shape[1], BLOCK_N=config.block_n, UPCAST=upcast_dot(q),
        SKIP_DECODES=skip_decodes, SLIDING=window > 0, SOFTCAP=softcap > 0, HAS_SINKS=sinks is not None,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return out
