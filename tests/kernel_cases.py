"""Random paged-attention problems and an fp32 reference, shared by the kernel tests and GPU checks.

Imports nothing from the engine except the kernels under test (via the callers), so the GPU check
script can run it where redis/pydantic are missing.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch


@dataclass
class PagedCase:
    q: torch.Tensor             # [num_tokens, H, D]
    k_cache: torch.Tensor       # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor
    cu_seqlens_q: torch.Tensor  # [B + 1] int32
    seqlens_k: torch.Tensor     # [B] int32
    block_tables: torch.Tensor  # [B, max_blocks] int32, -1 padded
    max_seqlen_q: int
    max_seqlen_k: int
    scale: float

    @property
    def is_decode(self) -> bool:
        return self.max_seqlen_q == 1 and self.q.shape[0] == self.seqlens_k.shape[0]


def make_case(q_lens: list[int], k_lens: list[int], num_heads: int, num_kv_heads: int, head_dim: int,
              block_size: int, dtype: torch.dtype, device: str | torch.device, seed: int = 0,
              extra_blocks: int = 3, extra_table_width: int = 1) -> PagedCase:
    """Sequences b with q_lens[b] new tokens and k_lens[b] context (cached prefix + new tokens).

    Each sequence's blocks are a random, non-contiguous subset of the pool; the unused tail of
    every block table is -1, and the pool has spare blocks full of noise that must never be read.
    """
    assert len(q_lens) == len(k_lens) and all(0 < q <= k for q, k in zip(q_lens, k_lens))
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [math.ceil(k / block_size) for k in k_lens]
    num_blocks = sum(blocks_per_seq) + extra_blocks
    perm = torch.randperm(num_blocks, generator=gen)
    width = max(blocks_per_seq) + extra_table_width
    block_tables = torch.full((len(k_lens), width), -1, dtype=torch.int32)
    used = 0
    for b, n in enumerate(blocks_per_seq):
        block_tables[b, :n] = perm[used:used + n].to(torch.int32)
        used += n
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    q = torch.randn(sum(q_lens), num_heads, head_dim, generator=gen).to(dtype)
    cu = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0).tolist()), dtype=torch.int32)
    return PagedCase(
        q=q.to(device), k_cache=k_cache.to(device), v_cache=v_cache.to(device),
        cu_seqlens_q=cu.to(device), seqlens_k=torch.tensor(k_lens, dtype=torch.int32, device=device),
        block_tables=block_tables.to(device), max_seqlen_q=max(q_lens), max_seqlen_k=max(k_lens),
        scale=head_dim ** -0.5)


def reference_attention(case: PagedCase, window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """fp32 causal attention, one sequence at a time, gathering each context block by block; window: a query
    at position i sees keys j with i - j < window (0: all); softcap: logits cap x tanh(logit / cap)."""
    q, k_cache, v_cache = case.q.float(), case.k_cache.float(), case.v_cache.float()
    block_size, num_kv_heads, head_dim = k_cache.shape[1:]
    group = q.shape[1] // num_kv_heads
    out = torch.empty_like(q)
    cu = case.cu_seqlens_q.tolist()
    for b, len_k in enumerate(case.seqlens_k.tolist()):
        start, end = cu[b], cu[b + 1]
        len_q = end - start
        blocks = case.block_tables[b, :math.ceil(len_k / block_size)].long()
        k = k_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:len_k].repeat_interleave(group, 1)
        v = v_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:len_k].repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", q[start:end], k) * case.scale
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        q_pos = torch.arange(len_k - len_q, len_k, device=q.device)[:, None]
        k_pos = torch.arange(len_k, device=q.device)[None, :]
        hidden = k_pos > q_pos
        if window:
            hidden |= q_pos - k_pos >= window
        scores = scores.masked_fill(hidden, float("-inf"))
        out[start:end] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
    return out


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def random_lengths(num_seqs: int, max_context: int, max_new: int, decode_share: float,
                   seed: int) -> tuple[list[int], list[int]]:
    """A mixed batch: some decodes (q_len 1), some chunks over cached prefixes, some fresh prompts."""
    gen = torch.Generator().manual_seed(seed)
    q_lens, k_lens = [], []
    for _ in range(num_seqs):
        kind = torch.rand(1, generator=gen).item()
        k_len = int(torch.randint(1, max_context + 1, (1,), generator=gen))
        if kind < decode_share:
            q_len = 1
        elif kind < (1 + decode_share) / 2:
            q_len = k_len  # fresh prompt, nothing cached
        else:
            q_len = int(torch.randint(1, min(k_len, max_new) + 1, (1,), generator=gen))
        q_lens.append(q_len)
        k_lens.append(k_len)
    return q_lens, k_lens


# ---- shape lists and the check runner (used by tests/test_kernels.py) ----

@dataclass(frozen=True)
class Shape:
    name: str
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    num_seqs: int
    max_context: int
    max_new: int
    decode_share: float = 0.4
    prefill_tiles: tuple[int, int] | None = None  # (block_m, block_n) override
    decode_block_n: int | None = None
    seed: int = 0


# Small enough for the Triton interpreter: every path (GQA 1/2/4/7/8, D 64/96/128, page sizes
# smaller than, equal to and larger than the KV tile, chunks over cached prefixes).
CPU_SHAPES = [
    Shape("mha_d64_bs16", 4, 4, 64, 16, 5, 70, 24),
    Shape("gqa2_d128_bs16_gather", 4, 2, 128, 16, 4, 60, 20, prefill_tiles=(32, 32), decode_block_n=32),
    Shape("gqa4_d64_bs32", 8, 2, 64, 32, 6, 100, 40),
    Shape("gqa8_d64_bs16", 8, 1, 64, 16, 4, 50, 30, decode_share=0.5),
    Shape("gqa7_d64_bs16", 14, 2, 64, 16, 3, 45, 17),
    Shape("gqa2_d96_bs64", 4, 2, 96, 64, 3, 150, 40),
]

# The GPU sizes: batch 1 to 256, contexts to 4k, engine block sizes 16 and 256.
GPU_SHAPES = [
    Shape("qwen3_0.6b_bs256_b64", 16, 8, 128, 256, 64, 2048, 512),
    Shape("qwen3_0.6b_bs16_b64", 16, 8, 128, 16, 64, 2048, 512),
    Shape("qwen3_8b_bs256_b256", 32, 8, 128, 256, 256, 1500, 300, decode_share=0.8),
    Shape("mha_d64_bs32_b32", 8, 8, 64, 32, 32, 1024, 300),
    Shape("gqa2_d64_bs16_b8", 16, 8, 64, 16, 8, 4096, 1024, decode_share=0.3),
    Shape("gqa4_d128_bs128_b1", 32, 8, 128, 128, 1, 3000, 3000, decode_share=0.0),
    Shape("gqa8_d128_bs64_b17", 64, 8, 128, 64, 17, 2500, 700),
    Shape("gqa8_d64_bs256_b200", 8, 1, 64, 256, 200, 1200, 200, decode_share=0.9),
    Shape("gqa7_d128_bs16_b12", 14, 2, 128, 16, 12, 900, 300),
]


def check_shape(shape: Shape, device: str, dtype: torch.dtype = torch.bfloat16) -> dict:
    """Run store_kvcache, prefill (mixed batch) and decode (several split counts) on one shape.

    Returns {check name: (relative error or mismatch count, all outputs written)}.
    """
    from engine.kernels import DecodeConfig, PrefillConfig, paged_decode, paged_prefill, store_kvcache
    from engine.kernels.paged_decode import decode_order

    results = {}
    q_lens, k_lens = random_lengths(shape.num_seqs, shape.max_context, shape.max_new,
                                    shape.decode_share, shape.seed)
    case = make_case(q_lens, k_lens, shape.num_heads, shape.num_kv_heads, shape.head_dim,
                     shape.block_size, dtype, device, seed=shape.seed)
    ref = reference_attention(case)
    prefill_config = None
    if shape.prefill_tiles:
        prefill_config = PrefillConfig(*shape.prefill_tiles, num_warps=4, num_stages=1 if device == "cpu" else 2)
    out = torch.full_like(case.q, float("nan"))
    paged_prefill(case.q, case.k_cache, case.v_cache, case.cu_seqlens_q, case.seqlens_k,
                  case.block_tables, case.max_seqlen_q, case.scale, out=out, config=prefill_config)
    results["prefill"] = (relative_error(out, ref), not out.isnan().any().item())
    # the backend's split: chunks through prefill, one-token rows through split-KV decode
    for splits in (None, 3):
        out = torch.full_like(case.q, float("nan"))
        paged_prefill(case.q, case.k_cache, case.v_cache, case.cu_seqlens_q, case.seqlens_k,
                      case.block_tables, case.max_seqlen_q, case.scale, out=out, config=prefill_config,
                      skip_decodes=True)
        paged_decode(case.q, case.k_cache, case.v_cache, case.seqlens_k, case.block_tables, case.max_seqlen_k,
                     case.scale, out=out, num_splits=splits, cu_seqlens_q=case.cu_seqlens_q,
                     order=None if splits is None else decode_order(case.seqlens_k))
        results[f"mixed_routed_{f'splits_{splits}_longest_first' if splits else 'default_splits'}"] = (
            relative_error(out, ref), not out.isnan().any().item())

    # decode: the last position of every sequence
    dec = make_case([1] * len(k_lens), k_lens, shape.num_heads, shape.num_kv_heads, shape.head_dim,
                    shape.block_size, dtype, device, seed=shape.seed + 1)
    dec_ref = reference_attention(dec)
    decode_config = None
    if shape.decode_block_n:
        decode_config = DecodeConfig(block_n=shape.decode_block_n, num_warps=4, num_stages=1 if device == "cpu" else 2)
    for splits in (None, 1, 3, 8):  # None: the split count choose_num_splits picks
        out = torch.full_like(dec.q, float("nan"))
        paged_decode(dec.q, dec.k_cache, dec.v_cache, dec.seqlens_k, dec.block_tables, dec.max_seqlen_k,
                     dec.scale, out=out, num_splits=splits, config=decode_config)
        results[f"decode_{f'splits_{splits}' if splits else 'default_splits'}"] = (
            relative_error(out, dec_ref), not out.isnan().any().item())
        if splits is None:
            continue
        # the grid's programs started longest sequence first, or in a random order: the same outputs
        gen = torch.Generator().manual_seed(shape.seed + 3)
        for order_name, order in (("longest_first", decode_order(dec.seqlens_k)),
                                  ("random", torch.randperm(len(k_lens), generator=gen).to(torch.int32).to(device))):
            ordered = torch.full_like(dec.q, float("nan"))
            paged_decode(dec.q, dec.k_cache, dec.v_cache, dec.seqlens_k, dec.block_tables, dec.max_seqlen_k,
                         dec.scale, out=ordered, num_splits=splits, config=decode_config, order=order)
            results[f"decode_splits_{splits}_order_{order_name}_identical"] = (
                float((ordered != out).sum().item()), not ordered.isnan().any().item())

    # store_kvcache: random distinct slots, some -1; untouched slots keep their values
    num_tokens = sum(q_lens)
    num_slots = case.k_cache.shape[0] * case.k_cache.shape[1]
    gen = torch.Generator().manual_seed(shape.seed + 2)
    slots = torch.randperm(num_slots, generator=gen)[:num_tokens]
    slots[torch.rand(num_tokens, generator=gen) < 0.1] = -1
    slots = slots.to(device)
    # K/V as strided views of a fused qkv buffer, as a model produces them
    qkv = torch.randn(num_tokens, shape.num_heads + 2 * shape.num_kv_heads, shape.head_dim,
                      generator=gen).to(dtype).to(device)
    key = qkv[:, shape.num_heads:shape.num_heads + shape.num_kv_heads]
    value = qkv[:, shape.num_heads + shape.num_kv_heads:]
    k_cache, v_cache = case.k_cache.clone(), case.v_cache.clone()
    store_kvcache(key, value, k_cache, v_cache, slots)
    k_ref, v_ref = case.k_cache.clone(), case.v_cache.clone()
    keep = slots >= 0
    k_ref.view(-1, *k_ref.shape[2:])[slots[keep]] = key[keep]
    v_ref.view(-1, *v_ref.shape[2:])[slots[keep]] = value[keep]
    mismatches = int((k_cache != k_ref).sum().item() + (v_cache != v_ref).sum().item())
    results["store_kvcache"] = (float(mismatches), True)
    return results


def check_decode_padding(device: str, dtype: torch.dtype = torch.bfloat16) -> dict:
    """CUDA-graph batch filler: rows with seqlen_k 0 and an all -1 block table, or seqlen_k 1 over
    block 0 (what the engine's graphs pad with), and slot -1, are written and stay finite."""
    from engine.kernels import paged_decode, store_kvcache

    dec = make_case([1, 1], [37, 5], 8, 2, 64, 16, dtype, device, seed=5)
    pad_rows = 3
    q = torch.cat([dec.q, torch.randn(pad_rows, 8, 64).to(dtype).to(device)])
    seqlens = torch.cat([dec.seqlens_k, torch.tensor([0, 0, 1], dtype=torch.int32, device=device)])
    tables = torch.cat([dec.block_tables, torch.full((pad_rows, dec.block_tables.shape[1]), -1,
                                                     dtype=torch.int32, device=device)])
    tables[-1] = 0
    ref = reference_attention(dec)
    results = {}
    for splits in (None, 1, 4):
        out = torch.full_like(q, float("nan"))
        paged_decode(q, dec.k_cache, dec.v_cache, seqlens, tables, 37, dec.scale, out=out, num_splits=splits)
        results[f"padded_decode_{splits or 'default_splits'}"] = (relative_error(out[:2], ref),
                                                          bool(torch.isfinite(out).all().item()))
    k_cache = dec.k_cache.clone()
    v_cache = dec.v_cache.clone()
    key = torch.randn(3, 2, 64).to(dtype).to(device)
    store_kvcache(key, key, k_cache, v_cache, torch.full((3,), -1, dtype=torch.int64, device=device))
    results["store_all_skipped"] = (float((k_cache != dec.k_cache).sum().item()), True)
    return results


# Decode batches of unequal lengths: (name, heads, KV heads, head dim, page, q_lens (None: all decodes), k_lens)
UNEQUAL_CASES = [
    ("gqa1_d64_unequal", 4, 4, 64, 16, None, [1, 5, 300, 17]),
    ("gqa2_d128_page8", 4, 2, 128, 8, None, [70, 33, 129, 2, 45]),
    ("gqa4_d64_page32", 8, 2, 64, 32, None, [97, 1, 250, 64, 31, 18]),
    ("short_wide_batch", 4, 2, 64, 16, None, [(7 * i) % 41 + 1 for i in range(20)]),
    ("gqa8_d128", 8, 1, 128, 16, None, [150, 3, 77]),
    ("batch1", 4, 2, 64, 16, None, [300]),
    ("mixed", 8, 2, 64, 16, [1, 9, 1, 30, 1], [20, 40, 300, 30, 7]),
]


def check_unequal_decode(device: str, dtype: torch.dtype = torch.bfloat16) -> dict:
    """Split-KV decode against the reference on batches of unequal lengths, longest sequence first; in a
    mixed batch it leaves the prefill rows to the prefill kernel."""
    from engine.kernels import paged_decode, paged_prefill
    from engine.kernels.paged_decode import decode_order

    results = {}
    for name, heads, kv_heads, head_dim, page, q_lens, k_lens in UNEQUAL_CASES:
        q_lens = q_lens or [1] * len(k_lens)
        case = make_case(q_lens, k_lens, heads, kv_heads, head_dim, page, dtype, device, seed=len(name))
        ref = reference_attention(case)
        mixed = case.cu_seqlens_q if max(q_lens) > 1 else None
        out = torch.full_like(case.q, float("nan"))
        paged_decode(case.q, case.k_cache, case.v_cache, case.seqlens_k, case.block_tables, case.max_seqlen_k,
                     case.scale, out=out, cu_seqlens_q=mixed, order=decode_order(case.seqlens_k))
        if mixed is not None:  # decode leaves the prefill rows alone; prefill fills them in
            decode_rows = torch.tensor([q == 1 for q in q_lens for _ in range(q)], device=device)
            untouched = out[~decode_rows].isnan().all().item()
            results[f"{name}_leaves_prefill_rows"] = (0.0 if untouched else 1.0, True)
            paged_prefill(case.q, case.k_cache, case.v_cache, case.cu_seqlens_q, case.seqlens_k,
                          case.block_tables, case.max_seqlen_q, case.scale, out=out, skip_decodes=True)
        results[f"{name}_decode"] = (relative_error(out, ref), not out.isnan().any().item())
    return results


def check_backend_contract(device: str, dtype: torch.dtype = torch.bfloat16) -> dict:
    """TritonBackend against the engine's TorchBackend through the AttentionMetadata contract."""
    from engine.attention import AttentionMetadata, has_decode_rows
    from engine.attention.torch_backend import TorchBackend
    from engine.attention.triton_backend import TritonBackend

    triton_backend, torch_backend = TritonBackend(), TorchBackend()
    results = {}
    for name, q_lens, k_lens in (("mixed", [1, 9, 1, 30], [20, 40, 33, 30]), ("decode", [1, 1, 1], [17, 1, 64])):
        case = make_case(q_lens, k_lens, 8, 2, 64, 16, dtype, device, seed=7)
        meta = AttentionMetadata(
            slot_mapping=torch.full((case.q.shape[0],), -1, dtype=torch.int32, device=device),
            cu_seqlens_q=case.cu_seqlens_q, seqlens_k=case.seqlens_k, block_tables=case.block_tables,
            max_seqlen_q=case.max_seqlen_q, max_seqlen_k=case.max_seqlen_k, is_decode=name == "decode")
        out = triton_backend.forward(case.q, case.k_cache, case.v_cache, meta, case.scale)
        ref = torch_backend.forward(case.q.float(), case.k_cache.float(), case.v_cache.float(), meta, case.scale)
        results[f"backend_{name}"] = (relative_error(out, ref), not out.isnan().any().item())
        results[f"reference_agrees_{name}"] = (relative_error(reference_attention(case), ref), True)
    # a prefill-only batch (no one-token row): the prefill kernel alone, no decode order sorted for it
    case = make_case([9, 30], [40, 30], 8, 2, 64, 16, dtype, device, seed=8)
    meta = AttentionMetadata(
        slot_mapping=torch.full((case.q.shape[0],), -1, dtype=torch.int32, device=device),
        cu_seqlens_q=case.cu_seqlens_q, seqlens_k=case.seqlens_k, block_tables=case.block_tables,
        max_seqlen_q=case.max_seqlen_q, max_seqlen_k=case.max_seqlen_k, is_decode=False,
        has_decode_rows=has_decode_rows(case.cu_seqlens_q.cpu()))
    out = triton_backend.forward(case.q, case.k_cache, case.v_cache, meta, case.scale)
    ref = torch_backend.forward(case.q.float(), case.k_cache.float(), case.v_cache.float(), meta, case.scale)
    results["backend_prefill_only"] = (relative_error(out, ref), not out.isnan().any().item())
    results["backend_prefill_only_sorted_no_decode_order"] = (float(meta.decode_order is not None), True)
    # one sequence padded as a prefill graph holds it: more query rows than the sequence has, which the
    # kernel must neither attend for it nor let change the sequence's own rows
    case = make_case([21], [37], 8, 2, 64, 16, dtype, device, seed=9)
    noise = torch.randn(11, *case.q.shape[1:], generator=torch.Generator().manual_seed(9)).to(dtype).to(device)
    meta = AttentionMetadata(
        slot_mapping=torch.full((32,), -1, dtype=torch.int32, device=device), cu_seqlens_q=case.cu_seqlens_q,
        seqlens_k=case.seqlens_k, block_tables=case.block_tables, max_seqlen_q=32, max_seqlen_k=case.max_seqlen_k,
        is_decode=False, has_decode_rows=False)
    padded = triton_backend.forward(torch.cat([case.q, noise]), case.k_cache, case.v_cache, meta, case.scale)[:21]
    ref = torch_backend.forward(case.q.float(), case.k_cache.float(), case.v_cache.float(), meta, case.scale)
    results["backend_prefill_padded"] = (relative_error(padded, ref), not padded.isnan().any().item())
    key = torch.randn(5, 2, 64).to(dtype).to(device)
    slots = torch.tensor([3, -1, 40, 7, 100], dtype=torch.int64, device=device)
    caches = [torch.randn(10, 16, 2, 64).to(dtype).to(device) for _ in range(2)]
    mine = [c.clone() for c in caches]
    triton_backend.store_kvcache(key, -key, mine[0], mine[1], slots)
    torch_backend.store_kvcache(key, -key, caches[0], caches[1], slots)
    results["backend_store_kvcache"] = (float(sum((a != b).sum().item() for a, b in zip(mine, caches))), True)
    results.update(_check_attention_layer_decode(triton_backend, torch_backend, device, dtype))
    # a Gemma layer: a window narrower than the contexts, soft-capped logits, the q/k norm scaling by 1 + weight
    results.update(_check_attention_layer_decode(triton_backend, torch_backend, device, dtype, window=6,
                                                 softcap=2.0, gemma=True))
    return results


def _check_attention_layer_decode(triton_backend, torch_backend, device: str, dtype: torch.dtype, window: int = 0,
                                  softcap: float = 0.0, gemma: bool = False) -> dict:
    """The Attention layer on a decode batch with each backend, from the same qkv rows: the triton one
    takes its one-kernel path (decode_from_qkv), the torch one the eager layers; outputs and caches."""
    from engine.attention import AttentionMetadata, ForwardContext
    from engine.layers.attention import Attention
    from engine.layers.fusion import PlainTorch
    from engine.layers.norm import GemmaRMSNorm, RMSNorm
    from engine.layers.rotary import RotaryEmbedding

    heads, kv_heads, head_dim, page = 8, 2, 64, 16
    case = make_case([1, 1, 1], [17, 1, 64], heads, kv_heads, head_dim, page, dtype, device, seed=11)
    gen = torch.Generator().manual_seed(11)
    qkv = torch.randn(3, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype).to(device)
    positions = (case.seqlens_k - 1).long()
    tables = case.block_tables.long()
    slots = tables[torch.arange(3, device=device), positions // page] * page + positions % page
    meta = AttentionMetadata(slot_mapping=slots, cu_seqlens_q=case.cu_seqlens_q, seqlens_k=case.seqlens_k,
                             block_tables=case.block_tables, max_seqlen_q=1, max_seqlen_k=case.max_seqlen_k,
                             is_decode=True)
    rotary = RotaryEmbedding(head_dim, 128, 1e6, {"rope_type": "default"}).to(device)
    norms = [(GemmaRMSNorm if gemma else RMSNorm)(head_dim, 1e-6).to(device) for _ in range(2)]
    for n in norms:
        n.weight.data = (torch.rand(head_dim, generator=gen) + 0.5).to(dtype).to(device)
    outs, caches, fused = [], [], []
    decode_from_qkv = triton_backend.decode_from_qkv

    def recorded(*args, **kwargs):  # whether the triton layer took the one-kernel path
        out = decode_from_qkv(*args, **kwargs)
        fused.append(out is not None)
        return out

    triton_backend.decode_from_qkv = recorded
    try:
        with PlainTorch():  # the eager layers, rounding at every op as the kernels emulate
            for backend in (triton_backend, torch_backend):
                layer = Attention(heads, kv_heads, head_dim, head_dim ** -0.5, ForwardContext(backend), window=window,
                                  softcap=softcap)
                layer.k_cache, layer.v_cache = case.k_cache.clone(), case.v_cache.clone()
                layer.ctx.meta = meta
                outs.append(layer(qkv, positions, rotary, norms[0], norms[1]))
                caches.append((layer.k_cache, layer.v_cache))
    finally:
        del triton_backend.decode_from_qkv
    name = "gemma_layer_decode" if gemma else "layer_decode"
    return {f"{name}_fused_path": (float(fused != [True]), True),
            name: (relative_error(outs[0], outs[1]), not outs[0].isnan().any().item()),
            f"{name}_k_cache": (relative_error(caches[0][0], caches[1][0]), True),
            f"{name}_store_v": (float((caches[0][1] != caches[1][1]).sum().item()), True)}


def check_qkv_prep(device: str, dtype: torch.dtype = torch.bfloat16, cache_dtype: torch.dtype | None = None) -> dict:
    """The fused qkv kernel against the eager layers it replaces: RMSNorm per head, rotary, K/V store
    (into caches of cache_dtype, default dtype: the eager values cast as torch casts them).

    `*_q_exact_share` is the share of query elements that differ from the eager layers' at all.
    """
    from engine.kernels import qkv_prep
    from engine.layers.fusion import PlainTorch
    from engine.layers.norm import GemmaRMSNorm, RMSNorm
    from engine.layers.rotary import RotaryEmbedding

    results = {}
    # gemma_*: Gemma 3's q/k norm, scaling by 1 + weight
    cases = (("qknorm_gqa2_d64", 4, 2, 64, True, 16), ("plain_gqa8_d96", 8, 1, 96, False, 32),
             ("qknorm_gqa7_d128", 14, 2, 128, True, 16), ("gemma_qknorm_gqa4_d256", 4, 1, 256, True, 16))
    for name, heads, kv_heads, head_dim, has_norm, page in cases:
        norm_class = GemmaRMSNorm if name.startswith("gemma") else RMSNorm
        gen = torch.Generator().manual_seed(len(name))
        num_tokens, num_blocks = 11, 6
        width = (heads + 2 * kv_heads) * head_dim
        # a row stride wider than the row, as a strided view of a larger projection output
        qkv = (torch.randn(num_tokens, width + 8, generator=gen) * 3).to(dtype).to(device)[:, :width]
        positions = torch.randint(0, 500, (num_tokens,), generator=gen).to(device)
        slots = torch.randperm(num_blocks * page, generator=gen)[:num_tokens]
        slots[torch.rand(num_tokens, generator=gen) < 0.25] = -1
        slots = slots.to(device)
        rotary = RotaryEmbedding(head_dim, 512, 1e6, {"rope_type": "default"}).to(device)
        norms = [norm_class(head_dim, 1e-6).to(device) for _ in range(2)]
        for n in norms:
            n.weight.data = (torch.rand(head_dim, generator=gen) + 0.5).to(dtype).to(device)
        caches = [torch.randn(num_blocks, page, kv_heads, head_dim, generator=gen).to(dtype).to(cache_dtype or dtype)
                  .to(device) for _ in range(2)]

        q_ref, k_ref, v_ref = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
        q_ref, k_ref = q_ref.reshape(-1, heads, head_dim), k_ref.reshape(-1, kv_heads, head_dim)
        v_ref = v_ref.reshape(-1, kv_heads, head_dim)
        # the eager layers (torch.compile'd chains round once at the end, eager ops at every step)
        with PlainTorch():
            if has_norm:
                q_ref, k_ref = norms[0](q_ref), norms[1](k_ref)
            q_ref, k_ref = rotary(positions, q_ref, k_ref)
        cache_ref = [c.clone() for c in caches]
        keep = slots >= 0
        cache_ref[0].view(-1, kv_heads, head_dim)[slots[keep]] = k_ref[keep].to(cache_ref[0].dtype)
        cache_ref[1].view(-1, kv_heads, head_dim)[slots[keep]] = v_ref[keep].to(cache_ref[1].dtype)

        mine = [c.clone() for c in caches]
        q = qkv_prep(qkv, positions, rotary.cos, rotary.sin, norms[0].weight if has_norm else None,
                     norms[1].weight if has_norm else None, 1e-6, mine[0], mine[1], slots,
                     heads, kv_heads, head_dim, unit_offset=norm_class.unit_offset)
        results[f"{name}_q"] = (relative_error(q, q_ref), not q.isnan().any().item())
        results[f"{name}_k_cache"] = (relative_error(mine[0], cache_ref[0]), True)
        # values are copied, and every slot that is not written keeps its old contents
        results[f"{name}_store_v"] = (float((mine[1] != cache_ref[1]).sum().item()), True)
        untouched = torch.ones(num_blocks * page, dtype=torch.bool, device=device)
        untouched[slots[keep]] = False
        results[f"{name}_store_untouched"] = (
            float((mine[0].view(num_blocks * page, -1)[untouched] != caches[0].view(num_blocks * page, -1)[untouched]).sum().item()), True)
        if dtype == torch.float32:  # float32 sums in another order: last-bit differences are expected
            continue
        # bit-compatibility with the eager layers (rounding emulated at every step)
        results[f"{name}_q_exact_share"] = (float((q != q_ref).float().mean().item()), True)
        results[f"{name}_k_exact_share"] = (float((mine[0] != cache_ref[0]).float().mean().item()), True)
    return results


FP8 = torch.float8_e4m3fn


def check_fp8_cache(device: str, dtype: torch.dtype = torch.bfloat16) -> dict:
    """A one-byte KV cache (kv_cache_dtype="fp8"): prefill, mixed and decode attention over fp8 caches
    against the fp32 reference over the same caches widened; store_kvcache and qkv_prep write what
    torch's cast of the model-dtype values gives, byte for byte; the triton and torch backends agree."""
    from engine.attention import AttentionMetadata
    from engine.attention.torch_backend import TorchBackend
    from engine.attention.triton_backend import TritonBackend
    from engine.kernels import paged_decode, paged_prefill, store_kvcache

    def fp8(case: PagedCase) -> PagedCase:
        case.k_cache, case.v_cache = case.k_cache.to(FP8), case.v_cache.to(FP8)
        return case

    def run(fn, like: torch.Tensor) -> torch.Tensor:
        out = torch.full_like(like, float("nan"))
        fn(out)
        return out

    results = {}
    q_lens, k_lens = [1, 9, 1, 30, 1], [20, 40, 70, 30, 7]
    case = fp8(make_case(q_lens, k_lens, 8, 2, 64, 16, dtype, device, seed=21))
    ref = reference_attention(case)
    args = (case.q, case.k_cache, case.v_cache, case.cu_seqlens_q, case.seqlens_k, case.block_tables,
            case.max_seqlen_q, case.scale)
    out = run(lambda o: paged_prefill(*args, out=o), case.q)
    results["fp8_prefill"] = (relative_error(out, ref), not out.isnan().any().item())
    out = run(lambda o: (paged_prefill(*args, out=o, skip_decodes=True),
                         paged_decode(case.q, case.k_cache, case.v_cache, case.seqlens_k, case.block_tables,
                                      case.max_seqlen_k, case.scale, out=o, cu_seqlens_q=case.cu_seqlens_q)), case.q)
    results["fp8_mixed_routed"] = (relative_error(out, ref), not out.isnan().any().item())
    dec = fp8(make_case([1] * 4, [37, 5, 130, 64], 8, 2, 128, 16, dtype, device, seed=22))
    dec_ref = reference_attention(dec)
    for splits in (None, 1, 3):
        out = run(lambda o: paged_decode(dec.q, dec.k_cache, dec.v_cache, dec.seqlens_k, dec.block_tables,
                                         dec.max_seqlen_k, dec.scale, out=o, num_splits=splits),
                  dec.q)
        results[f"fp8_decode_{splits or 'default_splits'}"] = (relative_error(out, dec_ref), not out.isnan().any().item())

    # stores: K/V as strided views of a qkv buffer, from subnormal to past fp8's largest value (448; the
    # kernels saturate there, torch's cast does on CPU but gives NaN from 480 up on CUDA), ties included
    gen = torch.Generator().manual_seed(23)
    qkv = (torch.randn(12, 8 + 2 * 2, 64, generator=gen) * torch.logspace(-3, 2, 64)).to(dtype)
    qkv[0, 8, :6] = torch.tensor([1000.0, -1000.0, 449.0, 300.0, 7.875, -3.625]).to(dtype)
    qkv = qkv.to(device)
    key, value = qkv[:, 8:10], qkv[:, 10:]
    slots = torch.randperm(10 * 16, generator=gen)[:12]
    slots[3] = -1
    slots = slots.to(device)
    caches = [case.k_cache.clone(), case.v_cache.clone()]
    refs = [c.clone() for c in caches]
    store_kvcache(key, value, caches[0], caches[1], slots)
    keep = slots >= 0
    refs[0].view(-1, 2, 64)[slots[keep]] = key[keep].clamp(-448, 448).to(FP8)  # saturated, as cvt.satfinite
    refs[1].view(-1, 2, 64)[slots[keep]] = value[keep].clamp(-448, 448).to(FP8)
    results["fp8_store_kvcache"] = (float(sum((a.view(torch.uint8) != b.view(torch.uint8)).sum().item()
                                              for a, b in zip(caches, refs))), True)
    try:
        results.update({f"fp8_{k}": v for k, v in check_qkv_prep(device, dtype, FP8).items()})
    except ImportError:  # the engine's layers are not importable here
        pass

    # the backends through the metadata contract: stores, then attention over what was stored
    triton_backend, torch_backend = TritonBackend(), TorchBackend()
    meta = AttentionMetadata(slot_mapping=torch.full((case.q.shape[0],), -1, dtype=torch.int32, device=device),
                             cu_seqlens_q=case.cu_seqlens_q, seqlens_k=case.seqlens_k, block_tables=case.block_tables,
                             max_seqlen_q=case.max_seqlen_q, max_seqlen_k=case.max_seqlen_k, is_decode=False)
    mine, theirs = [c.clone() for c in (case.k_cache, case.v_cache)], [c.clone() for c in (case.k_cache, case.v_cache)]
    triton_backend.store_kvcache(key, value, mine[0], mine[1], slots)
    torch_backend.store_kvcache(key, value, theirs[0], theirs[1], slots)
    results["fp8_backend_store_kvcache"] = (float(sum((a.view(torch.uint8) != b.view(torch.uint8)).sum().item()
                                                      for a, b in zip(mine, theirs))), True)
    out = triton_backend.forward(case.q, mine[0], mine[1], meta, case.scale)
    expected = torch_backend.forward(case.q.float(), theirs[0], theirs[1], meta, case.scale)
    results["fp8_backend_forward"] = (relative_error(out, expected), not out.isnan().any().item())
    return results


def check_norm_act(device: str, dtype: torch.dtype = torch.bfloat16) -> dict:
    """RMSNorm (with and without the residual add; Gemma's, scaling by 1 + weight), the gated activations
    (SiLU·mul, GELU-tanh·mul) and logit soft-capping kernels against the eager layers.

    The residual sum must be exact (`store_residual`: differing elements); `*_exact_share` is the share
    of outputs that differ from the eager layers' at all (the mean may be summed in another order).
    """
    from engine.kernels import norm_act
    from engine.layers import fusion

    results = {}
    with fusion.PlainTorch():  # the fusion functions below run their eager torch path
        for rows, hidden in ((1, 64), (5, 96), (3, 1024)):
            gen = torch.Generator().manual_seed(rows * hidden)
            x = (torch.randn(rows, hidden, generator=gen) * 2).to(dtype).to(device)
            residual = torch.randn(rows, hidden, generator=gen).to(dtype).to(device)
            for unit_offset in (False, True):
                name = f"rms_{rows}x{hidden}{'_unit_offset' if unit_offset else ''}"
                weight = (torch.rand(hidden, generator=gen) + (-0.5 if unit_offset else 0.5)).to(dtype).to(device)
                ref, ref_residual = fusion.add_rms_norm(x, residual, weight, 1e-6, unit_offset)
                out, new_residual = norm_act.rms_norm(x, weight, 1e-6, residual=residual, unit_offset=unit_offset)
                results[f"{name}_add"] = (relative_error(out, ref), not out.isnan().any().item())
                results[f"{name}_store_residual"] = (float((new_residual != ref_residual).sum().item()), True)
                plain_ref = fusion.rms_norm(x, weight, 1e-6, unit_offset)
                plain = norm_act.rms_norm(x, weight, 1e-6, unit_offset=unit_offset)
                results[f"{name}_plain"] = (relative_error(plain, plain_ref), not plain.isnan().any().item())
                if dtype == torch.bfloat16:
                    results[f"{name}_add_exact_share"] = (float((out != ref).float().mean().item()), True)
            packed = (torch.randn(rows, 2 * hidden, generator=gen) * 3).to(dtype).to(device)
            for act in ("silu", "gelu_tanh"):
                act_ref = fusion.act_and_mul(packed, act)
                out = norm_act.act_and_mul(packed, act)
                results[f"{act}_{rows}x{hidden}"] = (relative_error(out, act_ref), not out.isnan().any().item())
                # (GELU's 1 + tanh cancels for large negative gates, where the last-ulp differences of our
                # exp-based tanh and torch's move the tiny outputs: the relative error alone is checked)
                if dtype == torch.bfloat16 and act == "silu":
                    differ = float((out != act_ref).float().mean().item())
                    results[f"{act}_{rows}x{hidden}_exact_share"] = (differ, True)
            # logits from -40 to 40 (a strided view, as the LM head's slice of a padded vocabulary)
            logits = (torch.randn(rows, hidden + 5, generator=gen) * 15).to(dtype).to(device)[:, :hidden]
            capped_ref = fusion.soft_cap(logits.clone(), 4.0)
            capped = norm_act.soft_cap(logits.clone(), 4.0)
            results[f"soft_cap_{rows}x{hidden}"] = (relative_error(capped, capped_ref), not capped.isnan().any().item())
            if dtype == torch.bfloat16:
                results[f"soft_cap_{rows}x{hidden}_exact_share"] = (
                    float((capped != capped_ref).float().mean().item()), True)
    return results


# Sliding windows and soft-capped logits: (name, heads, KV heads, head dim, page, q_lens (None: all decodes),
# k_lens, window, softcap). Windows narrower than a KV tile, a page and a query tile, wider than every context,
# one position; the interpreter's tiles are 16 wide (decode, prefill) and 32 query rows.
WINDOW_CASES = [
    ("window5_mixed_gqa2", 4, 2, 64, 16, [1, 9, 1, 40, 1, 20], [20, 40, 70, 40, 7, 90], 5, 0.0),
    ("window24_prefill_chunks", 8, 2, 64, 16, [33, 50, 17], [70, 50, 120], 24, 0.0),
    ("window1_mixed", 4, 4, 64, 8, [1, 12, 1], [30, 12, 3], 1, 0.0),
    ("window_wider_than_context", 8, 1, 64, 16, [1, 25, 1], [35, 25, 9], 500, 0.0),
    ("window37_page32_decode", 8, 2, 128, 32, None, [100, 37, 38, 1, 250], 37, 0.0),
    ("softcap_mixed_gqa7", 14, 2, 64, 16, [1, 30, 1, 9], [50, 30, 17, 40], 0, 2.5),
    ("window12_softcap_gemma", 4, 2, 64, 16, [1, 33, 1, 20], [60, 33, 90, 41], 12, 3.0),
]


# the GPU sizes: Gemma 3 1B (head_dim 256, window 512), Gemma 2 2B (window 4096, cap 50), Phi-3-mini (head_dim 96,
# window 2047, contexts to 6000 so that most rows reach past it), and windows narrower than the GPU's KV and
# query tiles over 16-position pages
WINDOW_GPU_CASES = [
    ("gemma3_1b_window512", 4, 1, 256, 256, *random_lengths(48, 3000, 900, 0.6, 1), 512, 0.0),
    ("gemma2_2b_window4096_softcap", 8, 4, 256, 256, *random_lengths(24, 6000, 2000, 0.5, 2), 4096, 50.0),
    ("phi3_mini_window2047_d96", 32, 32, 96, 256, *random_lengths(12, 6000, 3000, 0.5, 3), 2047, 0.0),
    ("qwen_window100_page16", 16, 8, 128, 16, *random_lengths(32, 1500, 600, 0.5, 4), 100, 0.0),
    ("window7_softcap_d64", 8, 2, 64, 16, *random_lengths(20, 800, 300, 0.4, 5), 7, 20.0),
]


def check_windowed(device: str, dtype: torch.dtype = torch.bfloat16, cases=WINDOW_CASES) -> dict:
    """Prefill (every row through the prefill kernel), the backend's split (chunks through prefill, one-token
    rows through split-KV decode, at several split counts, longest first) and decode alone against the fp32
    reference with the same sliding window and soft-cap; the triton backend against the torch one."""
    from engine.attention import AttentionMetadata, has_decode_rows
    from engine.attention.torch_backend import TorchBackend
    from engine.attention.triton_backend import TritonBackend
    from engine.kernels import paged_decode, paged_prefill
    from engine.kernels.paged_decode import decode_order

    results = {}
    for seed, (name, heads, kv_heads, head_dim, page, q_lens, k_lens, window, softcap) in enumerate(cases):
        q_lens = q_lens or [1] * len(k_lens)
        case = make_case(q_lens, k_lens, heads, kv_heads, head_dim, page, dtype, device, seed=seed + 40)
        case.q = case.q * 3  # sharper attention: the window's edge and the cap matter
        ref = reference_attention(case, window, softcap)
        full = reference_attention(case)
        if softcap or window < max(k_lens):  # 0 where the reference moved (the error check wants below 1e-2)
            results[f"{name}_window_or_cap_matters"] = (float(relative_error(full, ref) < 0.05), True)
        common = (case.q, case.k_cache, case.v_cache)
        if max(q_lens) > 1:
            out = torch.full_like(case.q, float("nan"))
            paged_prefill(*common, case.cu_seqlens_q, case.seqlens_k, case.block_tables, case.max_seqlen_q,
                          case.scale, out=out, window=window, softcap=softcap)
            results[f"{name}_prefill"] = (relative_error(out, ref), not out.isnan().any().item())
        for splits in (None, 1, 3):
            out = torch.full_like(case.q, float("nan"))
            mixed = case.cu_seqlens_q if max(q_lens) > 1 else None
            if mixed is not None:
                paged_prefill(*common, case.cu_seqlens_q, case.seqlens_k, case.block_tables, case.max_seqlen_q,
                              case.scale, out=out, skip_decodes=True, window=window, softcap=softcap)
            paged_decode(*common, case.seqlens_k, case.block_tables, case.max_seqlen_k, case.scale, out=out,
                         num_splits=splits, cu_seqlens_q=mixed, order=decode_order(case.seqlens_k),
                         window=window, softcap=softcap)
            results[f"{name}_routed_splits_{splits or 'default'}"] = (relative_error(out, ref),
                                                                     not out.isnan().any().item())
        meta = AttentionMetadata(
            slot_mapping=torch.full((case.q.shape[0],), -1, dtype=torch.int32, device=device),
            cu_seqlens_q=case.cu_seqlens_q, seqlens_k=case.seqlens_k, block_tables=case.block_tables,
            max_seqlen_q=case.max_seqlen_q, max_seqlen_k=case.max_seqlen_k, is_decode=max(q_lens) == 1,
            has_decode_rows=has_decode_rows(case.cu_seqlens_q.cpu()))
        out = TritonBackend().forward(*common, meta, case.scale, window=window, softcap=softcap)
        expected = TorchBackend().forward(case.q.float(), case.k_cache.float(), case.v_cache.float(), meta,
                                          case.scale, window=window, softcap=softcap)
        results[f"{name}_backend"] = (relative_error(out, expected), not out.isnan().any().item())
        results[f"{name}_torch_backend_is_reference"] = (relative_error(expected, ref), True)
    return results


def _main() -> None:
    """Run the CPU shapes under the Triton interpreter and print one JSON object of results."""
    import json
    import os
    import sys

    os.environ["TRITON_INTERPRET"] = "1"  # must precede the first triton import
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    names = sys.argv[1:] or [s.name for s in CPU_SHAPES]
    torch.set_num_threads(1)
    results = {}
    for shape in CPU_SHAPES:
        if shape.name in names:
            results[shape.name] = check_shape(shape, "cpu")
    if "padding" in names or not sys.argv[1:]:
        results["padding"] = check_decode_padding("cpu")
    if "unequal" in names or not sys.argv[1:]:
        results["unequal"] = check_unequal_decode("cpu")
    if "qkv_prep" in names or not sys.argv[1:]:
        try:
            results["qkv_prep"] = {**check_qkv_prep("cpu"),
                                   **{f"fp32_{k}": v for k, v in check_qkv_prep("cpu", torch.float32).items()}}
        except ImportError as e:
            results["qkv_prep"] = {"skipped": str(e)}
    if "norm_act" in names or not sys.argv[1:]:
        results["norm_act"] = check_norm_act("cpu")
    if "windowed" in names or not sys.argv[1:]:
        try:
            results["windowed"] = check_windowed("cpu")
        except ImportError as e:  # the engine's attention package is not importable here
            results["windowed"] = {"skipped": str(e)}
    if "backend" in names or not sys.argv[1:]:
        try:
            results["backend"] = check_backend_contract("cpu")
        except ImportError as e:  # the engine's attention package is not importable here
            results["backend"] = {"skipped": str(e)}
    if "fp8" in names or not sys.argv[1:]:
        try:
            results["fp8"] = check_fp8_cache("cpu")
        except ImportError as e:
            results["fp8"] = {"skipped": str(e)}
    print(json.dumps(results))


if __name__ == "__main__":
    _main()
