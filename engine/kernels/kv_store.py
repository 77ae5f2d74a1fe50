"""Write this step's K and V into the paged cache: one program per token."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.paged_tiles import to_cache


@triton.jit
def _store_kvcache_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kc_page, stride_kc_slot, stride_kc_head,
    stride_vc_page, stride_vc_slot, stride_vc_head,
    num_kv_heads, head_dim,
    PAGE_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return  # padding token (CUDA-graph batch filler) or nothing to store
    page = slot // PAGE_SIZE
    offset = slot % PAGE_SIZE
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < num_kv_heads) & (offs_d[None, :] < head_dim)
    src = token.to(tl.int64)
    key = tl.load(key_ptr + src * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    value = tl.load(value_ptr + src * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    k_dst = k_cache_ptr + page * stride_kc_page + offset * stride_kc_slot
    v_dst = v_cache_ptr + page * stride_vc_page + offset * stride_vc_slot
    cache_dtype = k_cache_ptr.dtype.element_ty  # the model's dtype, or fp8 (rounded to nearest even, saturating)
    tl.store(k_dst + offs_h[:, None] * stride_kc_head + offs_d[None, :], to_cache(key, cache_dtype), mask=mask)
    tl.store(v_dst + offs_h[:, None] * stride_vc_head + offs_d[None, :], to_cache(value, cache_dtype), mask=mask)


def store_kvcache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """key/value [num_tokens, Hkv, D] -> caches [num_blocks, block_size, Hkv, D] at flat slots (-1 skips)."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    for t in (key, value):
        assert t.stride(-1) == 1, "K/V rows must be contiguous in the head dimension"
    for c in (k_cache, v_cache):
        assert c.dim() == 4 and c.stride(-1) == 1, "cache must be [num_blocks, block_size, Hkv, D]"
    assert k_cache.dtype == v_cache.dtype, "the K and V caches hold one dtype"
    assert slot_mapping.numel() == num_tokens
    _store_kvcache_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        num_kv_heads, head_dim,
        PAGE_SIZE=k_cache.shape[1],
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
    )
