"""Decode attention (one query token per sequence) over a paged KV cache, split-KV style.

Grid: (sequence, KV head, split). Each program reads one contiguous range of the sequence's KV
positions for all query heads of its KV head (packed as rows of one tl.dot) and leaves a partial
output with its log-sum-exp; a second kernel merges the splits. With enough sequences x KV heads
to fill the GPU, num_splits is 1 and the first kernel writes the output directly.

CUDA-graph safe: the split count and scratch sizes come from Python ints (batch, max_seqlen_k), and
each program derives its range from its own seqlen on the device, so any split count is correct.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from engine.kernels.paged_tiles import LOG2E, check_paged_inputs, group_pad, kv_tile_offsets, mma, upcast_dot


@dataclass(frozen=True)
class DecodeConfig:
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 3


@triton.jit
def _decode_split_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_out_ptr, part_lse_ptr,
    seqlens_k_ptr, block_tables_ptr, cu_seqlens_q_ptr,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_page, stride_slot, stride_khead, stride_bt,
    qk_scale, num_heads, num_splits,
    DIRECT: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr, MIXED: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    token = seq
    if MIXED:  # a varlen batch: act only on its one-token sequences, the prefill kernel does the rest
        token = tl.load(cu_seqlens_q_ptr + seq)
        if tl.load(cu_seqlens_q_ptr + seq + 1) - token != 1:
            return
    seqlen = tl.load(seqlens_k_ptr + seq)
    per_split = tl.cdiv(tl.cdiv(seqlen, num_splits), BLOCK_N) * BLOCK_N
    start = split * per_split
    end = tl.minimum(start + per_split, seqlen)

    offs_g = tl.arange(0, GROUP_PAD)
    head = kv_head * GROUP + offs_g
    g_mask = offs_g < GROUP
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    q = tl.load(q_ptr + token.to(tl.int64) * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)

    m_i = tl.full([GROUP_PAD], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([GROUP_PAD, BLOCK_D], dtype=tl.float32)
    block_table_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    head_offset = kv_head * stride_khead
    for n0 in range(start, end, BLOCK_N):
        offs, mask, valid_n = kv_tile_offsets(block_table_row, n0, end, head_offset, offs_d,
                                              stride_page, stride_slot, PAGE_SIZE, BLOCK_N,
                                              HEAD_DIM, BLOCK_D, True)
        k = tl.load(k_cache_ptr + offs, mask=mask, other=0.0)
        s = mma(q, tl.trans(k), UPCAST) * qk_scale
        s = tl.where(valid_n[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + offs, mask=mask, other=0.0)
        acc = acc * alpha[:, None] + mma(p.to(v.dtype), v, UPCAST)
        m_i = m_new

    has_keys = l_i > 0.0  # false for an empty split or a zero-length padding sequence
    out = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    if DIRECT:
        o_ptrs = out_ptr + token.to(tl.int64) * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :])
    else:
        # scratch layout: part_out [B, H, num_splits, BLOCK_D], part_lse [B, H, num_splits] (log2 domain)
        row = (seq.to(tl.int64) * num_heads + head) * num_splits + split
        tl.store(part_out_ptr + row[:, None] * BLOCK_D + offs_d[None, :], out, mask=g_mask[:, None])
        lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + row, lse, mask=g_mask)


@triton.jit
def _decode_reduce_kernel(
    part_out_ptr, part_lse_ptr, out_ptr, cu_seqlens_q_ptr, stride_ot, stride_oh, num_heads, num_splits,
    SPLITS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, MIXED: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    token = seq
    if MIXED:
        token = tl.load(cu_seqlens_q_ptr + seq)
        if tl.load(cu_seqlens_q_ptr + seq + 1) - token != 1:
            return
    row0 = (seq.to(tl.int64) * num_heads + head) * num_splits
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < num_splits
    lse = tl.load(part_lse_ptr + row0 + offs_s, mask=s_mask, other=float("-inf"))
    lse_max = tl.max(lse, 0)
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)  # padding sequence: all splits empty
    weight = tl.exp2(lse - lse_max)
    parts = tl.load(part_out_ptr + (row0 + offs_s)[:, None] * BLOCK_D + offs_d[None, :],
                    mask=s_mask[:, None], other=0.0)
    total = tl.sum(weight, 0)
    out = tl.sum(parts * weight[:, None], 0) / tl.where(total > 0.0, total, 1.0)
    tl.store(out_ptr + token.to(tl.int64) * stride_ot + head * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty),
             mask=offs_d < HEAD_DIM)


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_seqlen_k: int, block_n: int,
                      num_sms: int) -> int:
    """Enough programs for about four per SM (one program streams its range serially, so an SM needs
    several in flight to keep memory busy), each split at least two KV tiles long."""
    programs = num_seqs * num_kv_heads
    if programs >= 4 * num_sms:
        return 1
    wanted = triton.cdiv(4 * num_sms, programs)
    longest = max(1, triton.cdiv(max_seqlen_k, 2 * block_n))
    return max(1, min(wanted, longest, 64))


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def default_decode_config(q: torch.Tensor) -> DecodeConfig:
    if q.device.type != "cuda":
        return DecodeConfig(block_n=16, num_warps=4, num_stages=1)
    return DecodeConfig()


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 seqlens_k: torch.Tensor, block_tables: torch.Tensor, max_seqlen_k: int,
                 scale: float, out: torch.Tensor | None = None, num_splits: int | None = None,
                 config: DecodeConfig | None = None, cu_seqlens_q: torch.Tensor | None = None) -> torch.Tensor:
    """One query token per sequence (q: [B, H, D]) over its paged context of seqlens_k[b] positions.

    With cu_seqlens_q, q is a varlen batch: only its one-token sequences are computed (into their
    rows of `out`), the rest are left for paged_prefill(..., skip_decodes=True).
    """
    num_heads, num_kv_heads, group = check_paged_inputs(q, k_cache, v_cache)
    num_seqs, head_dim = seqlens_k.shape[0], q.shape[2]
    mixed = cu_seqlens_q is not None
    assert mixed or q.shape[0] == num_seqs, "decode needs one query token per sequence"
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if num_seqs == 0:
        return out
    config = config or default_decode_config(q)
    if num_splits is None:
        num_splits = choose_num_splits(num_seqs, num_kv_heads, max_seqlen_k, config.block_n,
                                       _num_sms(q.device))
    block_d = max(16, triton.next_power_of_2(head_dim))
    if num_splits > 1:
        part_out = torch.empty(num_seqs, num_heads, num_splits, block_d, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32, device=q.device)
    else:
        part_out = part_lse = out  # unused
    _decode_split_kernel[(num_seqs, num_kv_heads, num_splits)](
        q, k_cache, v_cache, out, part_out, part_lse, seqlens_k, block_tables,
        cu_seqlens_q if mixed else seqlens_k,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        scale * LOG2E, num_heads, num_splits,
        DIRECT=num_splits == 1, GROUP=group, GROUP_PAD=max(16, group_pad(group)),
        HEAD_DIM=head_dim, BLOCK_D=block_d, PAGE_SIZE=k_cache.shape[1], BLOCK_N=config.block_n,
        UPCAST=upcast_dot(q), MIXED=mixed, num_warps=config.num_warps, num_stages=config.num_stages,
    )
    if num_splits > 1:
        _decode_reduce_kernel[(num_seqs, num_heads)](
            part_out, part_lse, out, cu_seqlens_q if mixed else seqlens_k, out.stride(0), out.stride(1),
            num_heads, num_splits, SPLITS_PAD=triton.next_power_of_2(num_splits),
            HEAD_DIM=head_dim, BLOCK_D=block_d, MIXED=mixed, num_warps=4,
        )
    return out
