"""decode_stack (engine/kernels/decode_stack.py) against a layer-by-layer torch reference of the decoder
on the same weights and paged caches; shared by tests/test_decode_stack.py (the interpreter on CPU, one
launch per phase; the persistent kernel on CUDA). Run as a script, it prints one JSON object of the CPU
results.
"""
from __future__ import annotations

import json
import math
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# name, layers, hidden, heads, KV heads, head dim, intermediate, page size, context (this token included),
# q/k norm, programs (the CPU's grid; on CUDA one an SM)
CPU_CASES = [
    ("gqa2_qknorm", 2, 64, 4, 2, 16, 128, 16, 37, True, 4),
    ("mha_plain_uneven_rows", 2, 48, 2, 2, 16, 80, 8, 21, False, 6),
    ("gqa4_one_token", 1, 64, 8, 2, 16, 96, 16, 1, True, 5),
    ("gqa2_long_context", 1, 32, 2, 1, 32, 64, 16, 150, True, 3),
]
GPU_CASES = [
    ("qwen3_0.6b_shape_ctx771", 4, 1024, 16, 8, 128, 3072, 256, 771, True, None),
    ("qwen3_0.6b_shape_ctx1", 2, 1024, 16, 8, 128, 3072, 256, 1, True, None),
    ("qwen3_0.6b_shape_ctx4000_page16", 2, 1024, 16, 8, 128, 3072, 16, 4000, True, None),
    ("llama_like_gqa4_d64", 3, 512, 8, 2, 64, 1536, 32, 333, False, None),
]


def _round(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t.to(dtype).float()


def make_problem(layers: int, hidden: int, heads: int, kv_heads: int, head_dim: int, inter: int, page: int,
                 context: int, qk_norm: bool, dtype: torch.dtype, device: str, seed: int = 0):
    """Random weights (scaled so activations stay O(1)), caches over a shuffled page pool holding random
    K/V for the earlier positions, the step's inputs."""
    from engine.layers.rotary import RotaryEmbedding

    gen = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(device)

    pages = math.ceil(context / page)
    pool = pages + 5
    perm = torch.randperm(pool, generator=gen)[:pages].to(torch.int32)
    block_table = torch.full((pages + 2,), -1, dtype=torch.int32)
    block_table[:pages] = perm
    qkv_rows = (heads + 2 * kv_heads) * head_dim
    weights = []
    for _ in range(layers):
        weights.append({
            "qkv": rand(qkv_rows, hidden, scale=hidden ** -0.5),
            "o": rand(hidden, heads * head_dim, scale=(heads * head_dim) ** -0.5),
            "gate_up": rand(2 * inter, hidden, scale=hidden ** -0.5),
            "down": rand(hidden, inter, scale=inter ** -0.5),
            "input_norm": (1 + rand(hidden, scale=0.1)).to(dtype),
            "post_norm": (1 + rand(hidden, scale=0.1)).to(dtype),
            "q_norm": (1 + rand(head_dim, scale=0.1)).to(dtype) if qk_norm else None,
            "k_norm": (1 + rand(head_dim, scale=0.1)).to(dtype) if qk_norm else None,
            "k_cache": rand(pool, page, kv_heads, head_dim),
            "v_cache": rand(pool, page, kv_heads, head_dim),
        })
    rotary = RotaryEmbedding(head_dim, context + 16, 10000.0, {"rope_type": "default"})
    pos = context - 1
    slot = int(perm[pos // page]) * page + pos % page
    inputs = dict(x=rand(1, hidden), positions=torch.tensor([pos], device=device),
                  slot_mapping=torch.tensor([slot], device=device),
                  seqlens_k=torch.tensor([context], dtype=torch.int32, device=device),
                  block_table=block_table.to(device), cos=rotary.cos.to(device), sin=rotary.sin.to(device))
    return weights, inputs


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """The eager RMSNorm's roundings (engine.layers.fusion.rms_norm)."""
    dtype = x.dtype
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)


def reference(weights, inputs, heads: int, kv_heads: int, eps: float, scale: float):
    """(hidden, residual) of the layers in eager torch, K/V stored into (copies of) the caches."""
    x = inputs["x"]
    dtype = x.dtype
    pos, slot = int(inputs["positions"][0]), int(inputs["slot_mapping"][0])
    context = int(inputs["seqlens_k"][0])
    residual = None
    for w in weights:
        head_dim = w["k_cache"].shape[3]
        page = w["k_cache"].shape[1]
        r = x if residual is None else x + residual
        qkv = F.linear(_rms(r, w["input_norm"], eps), w["qkv"])
        q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1)
        q, k, v = q.view(heads, head_dim), k.view(kv_heads, head_dim), v.view(kv_heads, head_dim)
        if w["q_norm"] is not None:
            q, k = _rms(q, w["q_norm"], eps), _rms(k, w["k_norm"], eps)
        cos = inputs["cos"][pos].to(dtype)
        sin = inputs["sin"][pos].to(dtype)

        def rope(t):
            t1, t2 = t.chunk(2, -1)
            return torch.cat((t1 * cos - t2 * sin, t2 * cos + t1 * sin), -1)

        q, k = rope(q), rope(k)
        k_cache, v_cache = w["k_cache"].clone(), w["v_cache"].clone()
        k_cache.view(-1, kv_heads, head_dim)[slot] = k
        v_cache.view(-1, kv_heads, head_dim)[slot] = v
        positions = torch.arange(context, device=x.device)
        rows = inputs["block_table"].long()[positions // page] * page + positions % page
        keys = k_cache.view(-1, kv_heads, head_dim)[rows].float()      # [context, Hkv, D]
        values = v_cache.view(-1, kv_heads, head_dim)[rows].float()
        group = heads // kv_heads
        keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
        scores = torch.einsum("hd,thd->ht", q.float(), keys) * scale
        attn = torch.einsum("ht,thd->hd", scores.softmax(-1), values).to(dtype).reshape(1, -1)
        o = F.linear(attn, w["o"])
        residual = o + r
        gate, up = F.linear(_rms(residual, w["post_norm"], eps), w["gate_up"]).chunk(2, -1)
        x = F.linear(F.silu(gate) * up, w["down"])
        w["ref_k_cache"], w["ref_v_cache"] = k_cache, v_cache
    return x, residual


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12))


def run_case(case, dtype: torch.dtype, device: str, phases: bool, seed: int = 0) -> dict:
    from engine.kernels.decode_stack import DecodeStack

    name, layers, hidden, heads, kv_heads, head_dim, inter, page, context, qk_norm, programs = case
    weights, inputs = make_problem(layers, hidden, heads, kv_heads, head_dim, inter, page, context, qk_norm,
                                   dtype, device, seed)
    eps, scale = 1e-6, head_dim ** -0.5
    ref_hidden, ref_residual = reference(weights, inputs, heads, kv_heads, eps, scale)
    stack = DecodeStack([{k: v for k, v in w.items() if not k.startswith("ref_")} for w in weights], heads,
                        kv_heads, eps, eps, scale, programs=programs)
    hidden, residual = stack(**inputs, phases=phases)
    slot = int(inputs["slot_mapping"][0])
    cache_errors = []
    for w in weights:
        for which in ("k", "v"):
            got = w[f"{which}_cache"].view(-1, kv_heads, head_dim)
            want = w[f"ref_{which}_cache"].view(-1, kv_heads, head_dim)
            cache_errors.append(relative_error(got[slot], want[slot]))
            others = torch.ones(got.shape[0], dtype=torch.bool, device=got.device)
            others[slot] = False
            cache_errors.append(0.0 if torch.equal(got[others], want[others]) else 1.0)
    return {"hidden": relative_error(hidden, ref_hidden), "residual": relative_error(residual, ref_residual),
            "cache": max(cache_errors), "finite": bool(torch.isfinite(hidden).all()),
            "barrier_reset": stack.barrier.tolist() == [0, 0] and stack.tickets.eq(0).all().item()}


def main() -> None:
    results = {}
    for case in CPU_CASES:
        for dtype in (torch.float32, torch.bfloat16):
            results[f"{case[0]}_{str(dtype).split('.')[-1]}"] = run_case(case, dtype, "cpu", phases=True)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
