"""fused_decode (engine/kernels/fused_decode.py) against the two kernels it stands for, qkv_prep then
paged_decode, and against the fp32 reference; shared by tests/test_fused_decode.py (the interpreter on
CPU, the GPU shapes on CUDA). Run as a script, it prints one JSON object of the CPU results.
"""
from __future__ import annotations

import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kernel_cases import PagedCase, reference_attention, relative_error  # noqa: E402

# name, heads, KV heads, head dim, page size, context lengths (this step's token included), q/k norm,
# splits (None: the engine's choice), start longest first, padding rows (a CUDA graph's filler)
CPU_CASES = [
    ("gqa2_d64_norm", 4, 2, 64, 16, [37, 5, 64, 1], True, None, True, 0),
    ("gqa8_d128_norm_split4", 8, 1, 128, 32, [100, 3], True, 4, False, 0),
    ("mha_d64_plain_direct", 4, 4, 64, 16, [20, 50, 9], False, 1, False, 0),
    ("gqa7_d64_padded_split3", 14, 2, 64, 16, [45, 17], True, 3, True, 2),
    ("gqa4_d128_batch1_long", 8, 2, 128, 16, [300], True, None, False, 0),
    # 8 heads x 16 splits x 128 is more than the merge loads at once (MERGE_VALUES): two rounds of 4 heads
    ("gqa8_d128_split16_two_rounds", 8, 1, 128, 16, [200, 33], True, 16, False, 0),
    # one sequence whose last splits hold no positions: only the others take tickets (SKIP_EMPTY)
    ("gqa2_d64_one_seq_empty_splits", 4, 2, 64, 16, [70], True, 8, False, 0),
]
# sliding windows (narrower than a KV tile, across pages and splits), soft-capped logits and Gemma's q/k norm
# (scaling by 1 + weight): ..., window, softcap, unit_offset
WINDOW_CPU_CASES = [
    ("gqa2_d64_window5_split3", 4, 2, 64, 16, [37, 5, 64, 1], True, 3, True, 0, 5, 0.0, True),
    ("gqa4_d128_window40_softcap", 8, 2, 128, 16, [100, 41, 40, 7], True, None, True, 2, 40, 3.0, True),
    ("mha_d64_window17_split8_one_seq", 4, 4, 64, 16, [90], False, 8, False, 0, 17, 0.0, False),
    ("gqa2_d64_softcap_only", 4, 2, 64, 32, [70, 3], True, None, False, 0, 0, 2.0, False),
]
# with a one-byte KV cache (kv_cache_dtype="fp8"): stores round to fp8, the attention widens what it reads
FP8_CPU_CASES = [
    ("fp8_gqa2_d64_norm", 4, 2, 64, 16, [37, 5, 64, 1], True, None, True, 0),
    ("fp8_gqa4_d128_padded_split3", 8, 2, 128, 16, [45, 17], True, 3, True, 2),
    ("fp8_gqa2_d64_window9_softcap_gemma_norm", 4, 2, 64, 16, [37, 5, 64], True, 2, True, 0, 9, 2.0, True),
]
WINDOW_GPU_CASES = [  # Gemma 3 1B's shape (4 query heads, 1 KV head, head_dim 256, window 512) and Gemma 2's cap
    ("gemma3_1b_batch1_window512", 4, 1, 256, 256, [3000], True, None, False, 0, 512, 0.0, True),
    ("gemma3_1b_batch64_window512", 4, 1, 256, 256, [(97 * i) % 2500 + 1 for i in range(64)], True, None, True, 0,
     512, 0.0, True),
    ("gemma2_2b_batch16_window4096_softcap", 8, 4, 256, 256, [(301 * i) % 6000 + 1 for i in range(16)], False, None,
     True, 3, 4096, 50.0, False),
    ("mistral_7b_batch8_window4096", 32, 8, 128, 256, [(1411 * i) % 9000 + 1 for i in range(8)], False, None,
     True, 0, 4096, 0.0, False),
]
GPU_CASES = [
    ("qwen3_0.6b_batch1", 16, 8, 128, 256, [1024], True, None, False, 0),
    ("qwen3_0.6b_batch4_padded", 16, 8, 128, 256, [700, 1, 1500, 255], True, None, True, 4),
    ("qwen3_0.6b_batch256", 16, 8, 128, 256, [(37 * i) % 2000 + 1 for i in range(256)], True, None, True, 0),
    ("qwen3_8b_tp2_batch16", 16, 4, 128, 256, [(301 * i) % 3000 + 1 for i in range(16)], True, None, True, 0),
    ("gqa8_d64_page16_batch33", 8, 1, 64, 16, [(53 * i) % 900 + 1 for i in range(33)], False, None, True, 3),
    ("mha_d64_page32_split64", 8, 8, 64, 32, [4000, 17], True, 64, False, 0),
]
FP8_GPU_CASES = [
    ("fp8_qwen3_0.6b_batch1", 16, 8, 128, 256, [1024], True, None, False, 0),
    ("fp8_qwen3_0.6b_batch256", 16, 8, 128, 256, [(37 * i) % 2000 + 1 for i in range(256)], True, None, True, 0),
]


def decode_problem(heads: int, kv_heads: int, head_dim: int, page: int, lens: list[int], has_norm: bool,
             padding: int, dtype: torch.dtype, device: str, seed: int, cache_dtype: torch.dtype | None = None):
    """qkv rows (a strided view), positions, slots of each sequence's last position, block tables over a
    shuffled pool with spare noise blocks, caches (of cache_dtype, default dtype), rotary tables and norm
    weights."""
    from engine.layers.rotary import RotaryEmbedding

    gen = torch.Generator().manual_seed(seed)
    num_seqs = len(lens) + padding
    blocks = [math.ceil(n / page) for n in lens]
    num_blocks = sum(blocks) + 3
    perm = torch.randperm(num_blocks, generator=gen)
    tables = torch.zeros(num_seqs, max(blocks) + 1, dtype=torch.int32)  # padding rows: block 0, as the graphs
    tables[: len(lens)] = -1
    used = 0
    for b, n in enumerate(blocks):
        tables[b, :n] = perm[used:used + n].to(torch.int32)
        used += n
    seqlens = torch.tensor(lens + [1] * padding, dtype=torch.int32)
    positions = (seqlens - 1).to(torch.int64)
    slots = torch.tensor([int(tables[b, (n - 1) // page]) * page + (n - 1) % page for b, n in enumerate(lens)]
                         + [-1] * padding, dtype=torch.int64)
    width = (heads + 2 * kv_heads) * head_dim
    qkv = (torch.randn(num_seqs, width + 8, generator=gen) * 2).to(dtype)[:, :width]
    caches = [torch.randn(num_blocks, page, kv_heads, head_dim, generator=gen).to(dtype).to(cache_dtype or dtype)
              for _ in range(2)]
    rotary = RotaryEmbedding(head_dim, max(lens) + 1, 1e6, {"rope_type": "default"})
    weights = [(torch.rand(head_dim, generator=gen) + 0.5).to(dtype) for _ in range(2)] if has_norm else [None, None]
    to = lambda t: None if t is None else t.to(device)  # noqa: E731
    return (to(qkv), to(positions), to(slots), to(seqlens), to(tables), [to(c) for c in caches],
            to(rotary.cos), to(rotary.sin), [to(w) for w in weights])


def check_fused_decode(cases, device: str, dtype: torch.dtype = torch.bfloat16,
                       cache_dtype: torch.dtype | None = None) -> dict:
    """{check: (error or count, all written)} for each case: the output against the unfused kernels
    (relative error, and the share of elements that differ at all), the caches (the new V copied exactly,
    K as qkv_prep writes it, nothing else touched), the output against the fp32 reference, the counters
    left zero, and a second launch in the other read mode giving the same output (so the counters were
    reset, and reading the inputs before or after the wait changes nothing)."""
    from engine.kernels import paged_decode, qkv_prep
    from engine.kernels.fused_decode import fused_decode
    from engine.kernels.paged_decode import decode_order

    results = {}
    for seed, (name, heads, kv_heads, head_dim, page, lens, has_norm, splits, ordered, padding, *extra) in \
            enumerate(cases):
        window, softcap, unit_offset = extra or (0, 0.0, False)
        qkv, positions, slots, seqlens, tables, caches, cos, sin, (qw, kw) = decode_problem(
            heads, kv_heads, head_dim, page, lens, has_norm, padding, dtype, device, seed, cache_dtype)
        max_len = max(lens)
        order = decode_order(seqlens) if ordered else None
        scale = head_dim ** -0.5
        terms = dict(window=window, softcap=softcap)

        unfused = [c.clone() for c in caches]
        q = qkv_prep(qkv, positions, cos, sin, qw, kw, 1e-6, unfused[0], unfused[1], slots, heads, kv_heads, head_dim,
                     unit_offset=unit_offset)
        expected = paged_decode(q, unfused[0], unfused[1], seqlens, tables, max_len, scale, num_splits=splits,
                                order=order, **terms)

        fused = [c.clone() for c in caches]
        counters = torch.zeros(len(seqlens) * kv_heads + 5, dtype=torch.int32, device=device)
        # inputs read after the wait (as after cuBLAS), then before it (as after the GEMV)
        out = fused_decode(qkv, positions, cos, sin, qw, kw, 1e-6, fused[0], fused[1], slots, seqlens, tables,
                           max_len, scale, heads, kv_heads, counters, order=order, num_splits=splits,
                           after_gemv=False, unit_offset=unit_offset, **terms)
        again = fused_decode(qkv, positions, cos, sin, qw, kw, 1e-6, fused[0], fused[1], slots, seqlens, tables,
                             max_len, scale, heads, kv_heads, counters, order=order, num_splits=splits,
                             after_gemv=True, unit_offset=unit_offset, **terms)
        real = len(lens)
        finite = bool(torch.isfinite(out).all().item())  # padding rows too
        results[f"{name}_out"] = (relative_error(out[:real], expected[:real]), finite)
        results[f"{name}_out_exact_share"] = (float((out[:real] != expected[:real]).float().mean().item()), finite)
        results[f"{name}_rerun_identical"] = (float((again != out).sum().item()), True)
        results[f"{name}_store_v"] = (float((fused[1] != unfused[1]).sum().item()), True)
        results[f"{name}_k_cache_exact_share"] = (float((fused[0] != unfused[0]).float().mean().item()), True)
        written = torch.zeros(fused[0].shape[0] * page, dtype=torch.bool, device=device)
        written[slots[slots >= 0]] = True
        untouched = (fused[0].view(-1, kv_heads * head_dim)[~written] != caches[0].view(-1, kv_heads * head_dim)[~written])
        results[f"{name}_store_untouched"] = (float(untouched.sum().item()), True)
        results[f"{name}_store_counters_zero"] = (float((counters != 0).sum().item()), True)
        case = PagedCase(q=q[:real], k_cache=fused[0], v_cache=fused[1],
                         cu_seqlens_q=torch.arange(real + 1, dtype=torch.int32, device=device),
                         seqlens_k=seqlens[:real], block_tables=tables[:real], max_seqlen_q=1,
                         max_seqlen_k=max_len, scale=scale)
        results[f"{name}_reference"] = (relative_error(out[:real], reference_attention(case, window, softcap)), finite)
    return results


def check_cache_strides(cases, device: str, dtype: torch.dtype = torch.bfloat16) -> dict:
    """{check: (difference count, all written)}: the kernel on caches laid out head-major ([page, KV head,
    position, D], seen through strides as [page, position, KV head, D]) gives the output of the engine's
    layout bit for bit and stores the new token's K/V at the same logical place."""
    from engine.kernels.fused_decode import fused_decode

    results = {}
    for seed, (name, heads, kv_heads, head_dim, page, lens, has_norm, splits, ordered, padding) in enumerate(cases):
        qkv, positions, slots, seqlens, tables, caches, cos, sin, (qw, kw) = decode_problem(
            heads, kv_heads, head_dim, page, lens, has_norm, padding, dtype, device, seed)
        outs, stored = [], []
        for head_major in (False, True):
            if head_major:
                cache = [torch.empty(c.shape[0], kv_heads, page, head_dim, dtype=dtype, device=device).transpose(1, 2)
                         for c in caches]
                for c, src in zip(cache, caches):
                    c.copy_(src)
            else:
                cache = [c.clone() for c in caches]
            counters = torch.zeros(len(seqlens) * kv_heads, dtype=torch.int32, device=device)
            outs.append(fused_decode(qkv, positions, cos, sin, qw, kw, 1e-6, cache[0], cache[1], slots, seqlens,
                                     tables, max(lens), head_dim ** -0.5, heads, kv_heads, counters,
                                     num_splits=splits))
            stored.append(cache)
        finite = bool(torch.isfinite(outs[1]).all().item())
        results[f"{name}_head_major_identical"] = (float((outs[0] != outs[1]).sum().item()), finite)
        results[f"{name}_head_major_store"] = (float(sum((a != b).sum().item() for a, b in zip(*stored))), True)
    return results


def _main() -> None:
    import json

    os.environ["TRITON_INTERPRET"] = "1"  # must precede the first triton import
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    torch.set_num_threads(1)
    results = check_fused_decode(CPU_CASES + WINDOW_CPU_CASES, "cpu")
    results.update(check_fused_decode(FP8_CPU_CASES, "cpu", cache_dtype=torch.float8_e4m3fn))
    results.update(check_cache_strides(CPU_CASES[:2], "cpu"))
    print(json.dumps(results))


if __name__ == "__main__":
    _main()
