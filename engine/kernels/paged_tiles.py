"""Shared pieces of the paged-attention kernels: where a tile of KV positions lives in the cache."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.common import tanh


@triton.jit
def kv_tile_offsets(block_table_row, n0, seqlen, head_offset, offs_d,
                    stride_page, stride_slot,
                    PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, MASK_N: tl.constexpr):
    """Element offsets [BLOCK_N, BLOCK_D] of KV positions n0..n0+BLOCK_N-1 and their load mask.

    n0 is a multiple of BLOCK_N and < seqlen. When a page holds whole tiles the tile is one
    contiguous run inside one page (a single block-table read); otherwise each position looks
    its page up. MASK_N=False promises every position in the tile is < seqlen.
    """
    if PAGE_SIZE % BLOCK_N == 0:
        page = tl.load(block_table_row + n0 // PAGE_SIZE)
        offs, valid_n = page_tile_offsets(page, n0, seqlen, head_offset, offs_d, stride_page, stride_slot,
                                          PAGE_SIZE, BLOCK_N)
    else:
        offs_n = n0 + tl.arange(0, BLOCK_N)
        valid_n = offs_n < seqlen
        if MASK_N:
            page = tl.load(block_table_row + offs_n // PAGE_SIZE, mask=valid_n, other=0)
        else:
            page = tl.load(block_table_row + offs_n // PAGE_SIZE)
        row = page.to(tl.int64) * stride_page + (offs_n % PAGE_SIZE) * stride_slot
        offs = row[:, None] + head_offset + offs_d[None, :]
    if BLOCK_D == HEAD_DIM:
        mask = valid_n[:, None]
    else:
        mask = valid_n[:, None] & (offs_d[None, :] < HEAD_DIM)
    return offs, mask, valid_n


@triton.jit
def page_tile_offsets(page, n0, seqlen, head_offset, offs_d, stride_page, stride_slot,
                      PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):
    """Element offsets [BLOCK_N, len(offs_d)] of KV positions n0..n0+BLOCK_N-1, which lie in `page` (pages
    hold whole tiles), and which of them are < seqlen."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    row = page.to(tl.int64) * stride_page + (offs_n % PAGE_SIZE) * stride_slot
    return row[:, None] + head_offset + offs_d[None, :], offs_n < seqlen


@triton.jit
def scores_log2(dot, qk_scale, softcap, SOFTCAP: tl.constexpr):
    """Attention logits in the log2 domain from the q.k dot products: dot x qk_scale, or with SOFTCAP (Gemma 2's
    attention-logit soft-capping) softcap x tanh(dot x qk_scale). score_scales gives both factors."""
    if SOFTCAP:
        return tanh(dot * qk_scale) * softcap
    else:
        return dot * qk_scale


def score_scales(scale: float, softcap: float = 0.0) -> tuple[float, float]:
    """(qk_scale, softcap) for scores_log2: cap x tanh(q.k x scale / cap) in the log2 domain, or without a cap
    (softcap 0) q.k x scale."""
    if softcap:
        return scale / softcap, softcap * LOG2E
    return scale * LOG2E, 0.0


@triton.jit
def sink_share(lse, sinks_ptr, head, mask):
    """The factor that joins each row's attention sink (gpt-oss: a learned logit per query head, in the
    softmax's denominator with no value) to an output normalised over the keys alone: 1 / (1 + 2^(sink - lse)),
    sink in the log2 domain; lse: the log2-domain log-sum-exp of the row's scores (-inf for none: factor 0,
    where the output is 0 anyway)."""
    sink = tl.load(sinks_ptr + head, mask=mask, other=0.0).to(tl.float32) * 1.4426950408889634  # x log2(e)
    return 1.0 / (1.0 + tl.exp2(sink - lse))


def check_sinks(sinks: torch.Tensor | None, num_heads: int) -> None:
    """Attention sinks, where given, are one logit per query head."""
    assert sinks is None or (sinks.shape == (num_heads,) and sinks.is_contiguous()), \
        f"sinks must be [{num_heads}] (one per query head), got {None if sinks is None else tuple(sinks.shape)}"


@triton.jit
def window_start(seqlen, window, SLIDING: tl.constexpr):
    """The first KV position the last query position (seqlen - 1) sees: seqlen - window under a sliding window
    (a query at position i sees keys j with i - j < window), else 0."""
    if SLIDING:
        return tl.maximum(seqlen - window, 0)
    else:
        return seqlen * 0


@triton.jit
def prefetch_l2(ptrs):
    """Queue the 128-byte lines at ptrs into L2 (prefetch.global.L2): no register holds them and nothing
    waits for them, so a kernel can issue them before its wait for the kernel before it. GPU only."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def prefetch_page_tile(k_cache_ptr, v_cache_ptr, page, n0, end, head_offset, stride_page, stride_slot,
                       PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr):
    """prefetch_l2 of the K and V rows of positions n0..min(n0 + BLOCK_N, end) - 1 of one KV head, which lie
    in `page` (pages hold whole tiles): one prefetch a 128-byte line."""
    line: tl.constexpr = 1024 // k_cache_ptr.dtype.element_ty.primitive_bitwidth  # elements a 128-byte line
    lines: tl.constexpr = (HEAD_DIM + line - 1) // line
    offs, valid = page_tile_offsets(page, n0, end, head_offset, tl.arange(0, lines) * line, stride_page,
                                    stride_slot, PAGE_SIZE, BLOCK_N)
    offs = tl.where(valid[:, None], offs, page.to(tl.int64) * stride_page + head_offset)
    prefetch_l2(k_cache_ptr + offs)
    prefetch_l2(v_cache_ptr + offs)


@triton.jit
def round_to_e4m3(x):
    """fp32 x rounded to the nearest float8 e4m3 value (ties to even, saturating at +-448), as fp32: what
    a GPU's cvt.rn.satfinite gives, written out so that the Triton interpreter, whose emulated fp8 cast
    rounds ties away from zero and drops the carry into the exponent, stores the same bytes."""
    a = tl.minimum(tl.abs(x), 448.0)
    exponent = ((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    step = tl.maximum(exponent, -6) - 3  # 3 mantissa bits; subnormals below 2^-6 are spaced 2^-9
    magic = ((step + 150) << 23).to(tl.float32, bitcast=True) * 1.5  # its ulp is 2^step
    rounded = (a + magic) - magic
    # x's sign by its bit, so a negative value that rounds to zero stays -0 as in torch's cast
    sign = x.to(tl.int32, bitcast=True) & (-2147483647 - 1)
    return (rounded.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def to_cache(x, cache_dtype: tl.constexpr):
    """x as stored in a KV cache of cache_dtype: the model's dtype, or float8 e4m3 (rounded to nearest)."""
    if cache_dtype == tl.float8e4nv:
        return round_to_e4m3(x.to(tl.float32)).to(cache_dtype)
    return x.to(cache_dtype)


@triton.jit
def query_for_cache(q, cache_dtype: tl.constexpr):
    """q in the dtype that K/V tiles of cache_dtype widen to for the dot products: fp16 for an fp8 cache
    (e4m3 -> f16 is one instruction a pair, -> bf16 three), else q's own dtype."""
    if cache_dtype == tl.float8e4nv:  # static: one return, as the compiler wants one type from both paths
        q = q.to(tl.float16)
    return q


@triton.jit
def mma(a, b, UPCAST: tl.constexpr):
    """tl.dot(a, b) in fp32; float32 operands (a float32 model) in full precision, not TF32; UPCAST does it on
    fp32 operands (the CPU interpreter mis-multiplies bf16)."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32))
    if a.dtype == tl.float32:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)


def upcast_dot(t: torch.Tensor) -> bool:
    return t.device.type != "cuda" and t.dtype == torch.bfloat16


def check_paged_inputs(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int, int]:
    """Validate shapes/strides shared by the paged kernels; returns (num_heads, num_kv_heads, group)."""
    assert q.dim() == 3 and q.stride(-1) == 1, "q must be [num_tokens, H, D] with contiguous D"
    assert k_cache.dim() == 4 and k_cache.shape == v_cache.shape, "caches must be [blocks, block_size, Hkv, D]"
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1
    num_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
    assert q.shape[2] == k_cache.shape[3], f"head_dim of q ({q.shape[2]}) != cache ({k_cache.shape[3]})"
    assert num_heads % num_kv_heads == 0, f"{num_heads} query heads not a multiple of {num_kv_heads} KV heads"
    return num_heads, num_kv_heads, num_heads // num_kv_heads


def group_pad(group: int) -> int:
    """Rows one KV head's query heads take in a tile (a power of two)."""
    return triton.next_power_of_2(group)


LOG2E = 1.4426950408889634
