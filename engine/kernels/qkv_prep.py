"""From the packed qkv projection to attention inputs in one kernel: one program per token.

Splits the row into heads, applies the per-head q/k RMSNorm (Qwen3; Gemma 3's scales by 1 + weight) and the
rotary embedding (the two halves of the head), writes the rotated queries out and the keys and values straight
into the paged cache. Each step rounds where the eager torch layers round (norm in float32, cast, weight product;
every rotary product and sum cast back), so the fused result equals the unfused one in bf16.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.common import round_to
from engine.kernels.launch import launch_dependents, pdl_options, wait_for_previous
from engine.kernels.paged_tiles import to_cache


@triton.jit
def norm_rope(x1, x2, w_ptr, cos, sin, offs_half, mask_half, eps, head_dim,
              HAS_NORM: tl.constexpr, UNIT_OFFSET: tl.constexpr, HALF: tl.constexpr, dtype: tl.constexpr):
    """Rows of heads, split into halves [rows, HALF]: optional RMSNorm (UNIT_OFFSET: scaled by 1 + weight in
    float32 and rounded once, as Gemma's), then rotary; float32 out."""
    if HAS_NORM:
        mean_sq = (tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / head_dim
        inv = tl.math.rsqrt(mean_sq + eps)
        w1 = tl.load(w_ptr + offs_half, mask=mask_half, other=0.0).to(tl.float32)
        w2 = tl.load(w_ptr + HALF + offs_half, mask=mask_half, other=0.0).to(tl.float32)
        if UNIT_OFFSET:
            x1 = round_to(x1 * inv[:, None] * (1.0 + w1[None, :]), dtype)
            x2 = round_to(x2 * inv[:, None] * (1.0 + w2[None, :]), dtype)
        else:
            x1 = round_to(w1[None, :] * round_to(x1 * inv[:, None], dtype), dtype)
            x2 = round_to(w2[None, :] * round_to(x2 * inv[:, None], dtype), dtype)
    out1 = round_to(round_to(x1 * cos[None, :], dtype) - round_to(x2 * sin[None, :], dtype), dtype)
    out2 = round_to(round_to(x2 * cos[None, :], dtype) + round_to(x1 * sin[None, :], dtype), dtype)
    return out1, out2


@triton.jit
def _qkv_prep_kernel(
    qkv_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr,
    positions_ptr, slot_mapping_ptr, cos_ptr, sin_ptr, q_weight_ptr, k_weight_ptr,
    stride_t, stride_qo_t, stride_cos,
    stride_kc_page, stride_kc_slot, stride_vc_page, stride_vc_slot,
    num_heads, num_kv_heads, eps,
    HEAD_DIM: tl.constexpr, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_HKV: tl.constexpr, PAGE_SIZE: tl.constexpr,
    HAS_NORM: tl.constexpr, UNIT_OFFSET: tl.constexpr, PDL: tl.constexpr,
):
    launch_dependents(PDL)
    wait_for_previous(PDL)
    token = tl.program_id(0).to(tl.int64)
    dtype = q_out_ptr.dtype.element_ty
    row = qkv_ptr + token * stride_t
    pos = tl.load(positions_ptr + token)
    offs_half = tl.arange(0, BLOCK_HALF)
    mask_half = offs_half < HALF
    cos = round_to(tl.load(cos_ptr + pos * stride_cos + offs_half, mask=mask_half, other=0.0), dtype)
    sin = round_to(tl.load(sin_ptr + pos * stride_cos + offs_half, mask=mask_half, other=0.0), dtype)

    # queries: [heads, HALF] tiles of both halves
    offs_h = tl.arange(0, BLOCK_H)
    mask_q = (offs_h[:, None] < num_heads) & mask_half[None, :]
    q_lo = row + offs_h[:, None] * HEAD_DIM + offs_half[None, :]
    q1 = tl.load(q_lo, mask=mask_q, other=0.0).to(tl.float32)
    q2 = tl.load(q_lo + HALF, mask=mask_q, other=0.0).to(tl.float32)
    q1, q2 = norm_rope(q1, q2, q_weight_ptr, cos, sin, offs_half, mask_half, eps, HEAD_DIM, HAS_NORM, UNIT_OFFSET,
                       HALF, dtype)
    q_dst = q_out_ptr + token * stride_qo_t + offs_h[:, None] * HEAD_DIM + offs_half[None, :]
    tl.store(q_dst, q1.to(dtype), mask=mask_q)
    tl.store(q_dst + HALF, q2.to(dtype), mask=mask_q)

    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot >= 0:  # -1: padding row of a CUDA-graph batch, nothing to store
        offs_kv = tl.arange(0, BLOCK_HKV)
        mask_kv = (offs_kv[:, None] < num_kv_heads) & mask_half[None, :]
        k_lo = row + num_heads * HEAD_DIM + offs_kv[:, None] * HEAD_DIM + offs_half[None, :]
        v_lo = k_lo + num_kv_heads * HEAD_DIM
        k1 = tl.load(k_lo, mask=mask_kv, other=0.0).to(tl.float32)
        k2 = tl.load(k_lo + HALF, mask=mask_kv, other=0.0).to(tl.float32)
        k1, k2 = norm_rope(k1, k2, k_weight_ptr, cos, sin, offs_half, mask_half, eps, HEAD_DIM, HAS_NORM,
                           UNIT_OFFSET, HALF, dtype)
        page, offset = slot // PAGE_SIZE, slot % PAGE_SIZE
        heads = offs_kv[:, None] * HEAD_DIM + offs_half[None, :]
        k_dst = k_cache_ptr + page * stride_kc_page + offset * stride_kc_slot + heads
        v_dst = v_cache_ptr + page * stride_vc_page + offset * stride_vc_slot + heads
        cache_dtype = k_cache_ptr.dtype.element_ty  # the model's dtype, or fp8 (rounded from it)
        tl.store(k_dst, to_cache(k1.to(dtype), cache_dtype), mask=mask_kv)
        tl.store(k_dst + HALF, to_cache(k2.to(dtype), cache_dtype), mask=mask_kv)
        tl.store(v_dst, to_cache(tl.load(v_lo, mask=mask_kv), cache_dtype), mask=mask_kv)
        tl.store(v_dst + HALF, to_cache(tl.load(v_lo + HALF, mask=mask_kv), cache_dtype), mask=mask_kv)


def qkv_prep(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
             q_weight: torch.Tensor | None, k_weight: torch.Tensor | None, eps: float,
             k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
             num_heads: int, num_kv_heads: int, head_dim: int, unit_offset: bool = False) -> torch.Tensor:
    """Rotated (and normed) queries [T, H, D]; keys and values go into the caches at `slot_mapping`.

    qkv: [T, (H + 2 Hkv) D] rows (q heads, then k, then v); cos/sin: [max_position, D / 2] float32
    tables; q_weight/k_weight: the per-head RMSNorm weights [D], or both None for no q/k norm; unit_offset:
    the norms scale by 1 + weight (Gemma's).
    """
    num_tokens = qkv.shape[0]
    assert qkv.shape[1] == (num_heads + 2 * num_kv_heads) * head_dim and qkv.stride(1) == 1
    assert head_dim % 2 == 0 and cos.shape == sin.shape and cos.stride(1) == 1 and sin.stride() == cos.stride()
    for c in (k_cache, v_cache):
        assert c.dim() == 4 and c.shape[2:] == (num_kv_heads, head_dim) and c.stride(-1) == 1 \
            and c.stride(2) == head_dim, "cache must be [num_blocks, block_size, Hkv, D], rows contiguous"
    assert (q_weight is None) == (k_weight is None)
    q = torch.empty(num_tokens, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    if num_tokens == 0:
        return q
    has_norm = q_weight is not None
    half = head_dim // 2
    _qkv_prep_kernel[(num_tokens,)](
        qkv, q, k_cache, v_cache, positions, slot_mapping, cos, sin,
        q_weight if has_norm else cos, k_weight if has_norm else cos,
        qkv.stride(0), q.stride(0), cos.stride(0),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        num_heads, num_kv_heads, eps,
        HEAD_DIM=head_dim, HALF=half, BLOCK_HALF=triton.next_power_of_2(half),
        BLOCK_H=triton.next_power_of_2(num_heads), BLOCK_HKV=triton.next_power_of_2(num_kv_heads),
        PAGE_SIZE=k_cache.shape[1], HAS_NORM=has_norm, UNIT_OFFSET=unit_offset, **pdl_options(qkv),
    )
    return q
