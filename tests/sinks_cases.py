"""Attention sinks (gpt-oss: a learned logit per query head that joins the softmax's denominator and carries
no value) in the Triton kernels, against an fp32 reference and the engine's TorchBackend, with and without
sliding windows; shared by tests/test_attention_sinks.py (the interpreter on CPU, larger shapes on CUDA).
Run as a script, it prints one JSON object of the CPU results.
"""
from __future__ import annotations

import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fused_decode_cases import decode_problem  # noqa: E402
from kernel_cases import PagedCase, make_case, relative_error  # noqa: E402

# name, heads, KV heads, head dim, page size, query lengths (None: one-token decode rows), context lengths,
# window (0: none)
CPU_CASES = [
    ("gqa2_d64_mixed", 4, 2, 64, 16, [9, 1, 20, 1], [40, 17, 20, 64], 0),
    ("gqa2_d64_mixed_window7", 4, 2, 64, 16, [9, 1, 20, 1], [40, 17, 20, 64], 7),
    ("gqa8_d64_decode_window20", 8, 1, 64, 32, None, [100, 3, 21], 20),
    ("mha_d64_decode", 4, 4, 64, 16, None, [50, 1, 33], 0),
    # pages of 4 positions under tiles of 16: a tile that holds the window's first key starts in handed-back pages
    ("gqa2_d64_mixed_window7_page4", 4, 2, 64, 4, [9, 1, 20, 1], [40, 17, 20, 64], 7),
]
GPU_CASES = [  # gpt-oss-20b's attention per GPU: 64 query heads, 8 KV heads, head_dim 64, window 128
    ("gpt_oss_20b_mixed", 64, 8, 64, 256, [300, 1, 1, 700, 1], [300, 900, 2000, 1500, 129], 0),
    ("gpt_oss_20b_mixed_window128", 64, 8, 64, 256, [300, 1, 1, 700, 1], [300, 900, 2000, 1500, 129], 128),
    ("gpt_oss_20b_decode64_window128", 64, 8, 64, 256, None, [(97 * i) % 3000 + 1 for i in range(64)], 128),
    ("gpt_oss_20b_decode8", 64, 8, 64, 16, None, [(301 * i) % 4000 + 1 for i in range(8)], 0),
]
# fused decode: name, heads, KV heads, head dim, page size, context lengths, splits (None: the engine's), window
FUSED_CPU_CASES = [
    ("fused_gqa2_d64_split3", 4, 2, 64, 16, [37, 5, 64, 1], 3, 0),
    ("fused_gqa2_d64_direct_window9", 4, 2, 64, 16, [37, 5, 64], 1, 9),
    ("fused_gqa8_d64_default_window20", 8, 1, 64, 16, [90, 2], None, 20),
]
FUSED_GPU_CASES = [
    ("fused_gpt_oss_20b_batch1", 64, 8, 64, 256, [2000], None, 0),
    ("fused_gpt_oss_20b_batch1_window128", 64, 8, 64, 256, [2000], None, 128),
    ("fused_gpt_oss_20b_batch64_window128", 64, 8, 64, 256, [(37 * i) % 2000 + 1 for i in range(64)], None, 128),
]


def make_sinks(heads: int, device: str, seed: int) -> torch.Tensor:
    """Sinks around the scores' size, some far above them (they take most of the mass) and some far below."""
    gen = torch.Generator().manual_seed(seed)
    sinks = torch.randn(heads, generator=gen) * 2
    sinks[0], sinks[-1] = 8.0, -30.0
    return sinks.to(device)


def reference_attention_with_sinks(case: PagedCase, sinks: torch.Tensor | None, window: int = 0) -> torch.Tensor:
    """fp32 causal attention, one sequence at a time, each head's sink one more softmax column with no value."""
    q, k_cache, v_cache = case.q.float(), case.k_cache.float(), case.v_cache.float()
    block_size, num_kv_heads, head_dim = k_cache.shape[1:]
    group = q.shape[1] // num_kv_heads
    out = torch.empty_like(q)
    cu = case.cu_seqlens_q.tolist()
    for b, len_k in enumerate(case.seqlens_k.tolist()):
        start, end = cu[b], cu[b + 1]
        blocks = case.block_tables[b, :math.ceil(len_k / block_size)].long()
        k = k_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:len_k].repeat_interleave(group, 1)
        v = v_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:len_k].repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", q[start:end], k) * case.scale
        q_pos = torch.arange(len_k - (end - start), len_k, device=q.device)[:, None]
        k_pos = torch.arange(len_k, device=q.device)[None, :]
        hidden = (k_pos > q_pos) | ((q_pos - k_pos >= window) if window else False)
        scores = scores.masked_fill(hidden, float("-inf"))
        if sinks is not None:
            column = sinks.float()[:, None, None].expand(-1, end - start, 1)
            probs = torch.cat([scores, column], -1).softmax(-1)[..., :-1]
        else:
            probs = scores.softmax(-1)
        out[start:end] = torch.einsum("hqk,khd->qhd", probs, v)
    return out


def hand_back_out_of_window(case: PagedCase, window: int) -> torch.Tensor:
    """The block tables as the engine leaves them where every layer slides (BlockManager.release_out_of_window):
    each page wholly before the window of its sequence's first query token points at the first page it still
    holds, whose keys the kernels may read there but must not weigh."""
    tables = case.block_tables.clone()
    page = case.k_cache.shape[1]
    q_lens = (case.cu_seqlens_q[1:] - case.cu_seqlens_q[:-1]).tolist()
    for b, (q_len, len_k) in enumerate(zip(q_lens, case.seqlens_k.tolist())):
        keep_from = max(len_k - q_len - window + 1, 0) // page
        tables[b, :keep_from] = tables[b, keep_from]
    return tables


def check_sinks(device: str, cases=CPU_CASES, dtype: torch.dtype = torch.bfloat16) -> dict:
    """{check: (relative error, all written)}: prefill, the backend's split of a mixed batch (several split
    counts) and decode alone against the reference with sinks; the triton backend against the torch one; and
    that the sinks matter (the reference without them is far off)."""
    from engine.attention import AttentionMetadata, has_decode_rows
    from engine.attention.torch_backend import TorchBackend
    from engine.attention.triton_backend import TritonBackend
    from engine.kernels import paged_decode, paged_prefill
    from engine.kernels.paged_decode import decode_order

    results = {}
    for seed, (name, heads, kv_heads, head_dim, page, q_lens, k_lens, window) in enumerate(cases):
        q_lens = q_lens or [1] * len(k_lens)
        case = make_case(q_lens, k_lens, heads, kv_heads, head_dim, page, dtype, device, seed=seed + 70)
        case.q = case.q * 2
        sinks = make_sinks(heads, device, seed)
        ref = reference_attention_with_sinks(case, sinks, window)
        without = reference_attention_with_sinks(case, None, window)
        results[f"{name}_sinks_matter"] = (float(relative_error(without, ref) < 0.05), True)
        common = (case.q, case.k_cache, case.v_cache)
        terms = dict(window=window, sinks=sinks)
        if max(q_lens) > 1:
            out = torch.full_like(case.q, float("nan"))
            paged_prefill(*common, case.cu_seqlens_q, case.seqlens_k, case.block_tables, case.max_seqlen_q,
                          case.scale, out=out, **terms)
            results[f"{name}_prefill"] = (relative_error(out, ref), not out.isnan().any().item())
        for splits in (None, 1, 3):
            out = torch.full_like(case.q, float("nan"))
            mixed = case.cu_seqlens_q if max(q_lens) > 1 else None
            if mixed is not None:
                paged_prefill(*common, case.cu_seqlens_q, case.seqlens_k, case.block_tables, case.max_seqlen_q,
                              case.scale, out=out, skip_decodes=True, **terms)
            paged_decode(*common, case.seqlens_k, case.block_tables, case.max_seqlen_k, case.scale, out=out,
                         num_splits=splits, cu_seqlens_q=mixed, order=decode_order(case.seqlens_k), **terms)
            results[f"{name}_routed_splits_{splits or 'default'}"] = (relative_error(out, ref),
                                                                     not out.isnan().any().item())
        if window:  # pages before the windows handed back: the same outputs
            tables = hand_back_out_of_window(case, window)
            results[f"{name}_pages_handed_back"] = (float(not (tables != case.block_tables).any().item()), True)
            out = torch.full_like(case.q, float("nan"))
            if max(q_lens) > 1:
                paged_prefill(*common, case.cu_seqlens_q, case.seqlens_k, tables, case.max_seqlen_q, case.scale,
                              out=out, skip_decodes=True, **terms)
            paged_decode(*common, case.seqlens_k, tables, case.max_seqlen_k, case.scale, out=out, num_splits=3,
                         cu_seqlens_q=case.cu_seqlens_q if max(q_lens) > 1 else None, **terms)
            results[f"{name}_handed_back_routed"] = (relative_error(out, ref), not out.isnan().any().item())
        meta = AttentionMetadata(
            slot_mapping=torch.full((case.q.shape[0],), -1, dtype=torch.int32, device=device),
            cu_seqlens_q=case.cu_seqlens_q, seqlens_k=case.seqlens_k, block_tables=case.block_tables,
            max_seqlen_q=case.max_seqlen_q, max_seqlen_k=case.max_seqlen_k, is_decode=max(q_lens) == 1,
            has_decode_rows=has_decode_rows(case.cu_seqlens_q.cpu()))
        out = TritonBackend().forward(*common, meta, case.scale, **terms)
        expected = TorchBackend().forward(case.q.float(), case.k_cache.float(), case.v_cache.float(), meta,
                                          case.scale, **terms)
        results[f"{name}_backend"] = (relative_error(out, expected), not out.isnan().any().item())
        results[f"{name}_torch_backend_is_reference"] = (relative_error(expected, ref), True)
    return results


def check_fused_sinks(device: str, cases=FUSED_CPU_CASES, dtype: torch.dtype = torch.bfloat16) -> dict:
    """{check: (relative error, all written)}: fused decode with sinks against qkv_prep then paged_decode with
    the same sinks, and against the reference."""
    from engine.kernels import paged_decode, qkv_prep
    from engine.kernels.fused_decode import fused_decode

    results = {}
    for seed, (name, heads, kv_heads, head_dim, page, lens, splits, window) in enumerate(cases):
        qkv, positions, slots, seqlens, tables, caches, cos, sin, _ = decode_problem(
            heads, kv_heads, head_dim, page, lens, False, 0, dtype, device, seed + 90)
        sinks = make_sinks(heads, device, seed + 5)
        scale = head_dim ** -0.5
        unfused = [c.clone() for c in caches]
        q = qkv_prep(qkv, positions, cos, sin, None, None, 1e-6, unfused[0], unfused[1], slots, heads, kv_heads,
                     head_dim)
        expected = paged_decode(q, unfused[0], unfused[1], seqlens, tables, max(lens), scale, num_splits=splits,
                                window=window, sinks=sinks)
        fused = [c.clone() for c in caches]
        counters = torch.zeros(len(lens) * kv_heads, dtype=torch.int32, device=device)
        out = fused_decode(qkv, positions, cos, sin, None, None, 1e-6, fused[0], fused[1], slots, seqlens, tables,
                           max(lens), scale, heads, kv_heads, counters, num_splits=splits, window=window, sinks=sinks)
        finite = bool(torch.isfinite(out).all().item())
        results[f"{name}_out"] = (relative_error(out, expected), finite)
        case = PagedCase(q=q, k_cache=fused[0], v_cache=fused[1],
                         cu_seqlens_q=torch.arange(len(lens) + 1, dtype=torch.int32, device=device),
                         seqlens_k=seqlens, block_tables=tables, max_seqlen_q=1, max_seqlen_k=max(lens), scale=scale)
        results[f"{name}_reference"] = (relative_error(out, reference_attention_with_sinks(case, sinks, window)),
                                        finite)
    return results


def _main() -> None:
    import json

    os.environ["TRITON_INTERPRET"] = "1"  # must precede the first triton import
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    torch.set_num_threads(1)
    print(json.dumps({**check_sinks("cpu"), **check_fused_sinks("cpu")}))


if __name__ == "__main__":
    _main()
