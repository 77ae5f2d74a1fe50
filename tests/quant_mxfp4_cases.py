"""Cases for the fused MoE kernels on MXFP4 experts (engine/kernels/fused_moe.py, mxfp4_scales) under the Triton
interpreter: against the expert-by-expert reference on the dequantized experts (engine/layers/quant/mxfp4.py
dequantize), into NaN-poisoned buffers, and a tiny MXFP4 gpt-oss through the engine with its MoE layers on the
kernels against transformers on the dequantized weights. Run by tests/test_quant_mxfp4.py with TRITON_INTERPRET=1.
Prints one JSON object: {case: outcome}.
"""
from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.kernels import fused_moe  # noqa: E402
from engine.layers.moe import experts_reference, route  # noqa: E402
from engine.layers.quant.mxfp4 import dequantize  # noqa: E402
from tests.quant_helpers import mxfp4_quantize  # noqa: E402


def inputs(tokens: int, hidden: int, inter: int, num_experts: int, top_k: int, bias: bool, seed: int, dtype):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=gen) / hidden ** 0.5
    w13_blocks, w13_scales, _ = mxfp4_quantize(w13)
    w2_blocks, w2_scales, _ = mxfp4_quantize(torch.randn(num_experts, hidden, inter, generator=gen) / inter ** 0.5)
    packed = (w13_blocks.flatten(2), w13_scales, w2_blocks.flatten(2), w2_scales)
    b13 = torch.randn(num_experts, 2 * inter, generator=gen).to(dtype) if bias else None
    b2 = torch.randn(num_experts, hidden, generator=gen).to(dtype) if bias else None
    weights, experts = route(torch.randn(tokens, num_experts, generator=gen), top_k, renormalize=True)
    return x, packed, b13, b2, weights, experts


def case_matches(tokens, hidden, inter, num_experts, top_k, bias=False, activation="silu", dtype=torch.float32):
    x, (w13, s13, w2, s2), b13, b2, weights, experts = inputs(tokens, hidden, inter, num_experts, top_k, bias, 0,
                                                              dtype)
    want = experts_reference(x, dequantize(w13, s13, dtype), dequantize(w2, s2, dtype), weights, experts, b13, b2,
                             activation, 1.702, 1.5)
    got = fused_moe.fused_experts(x, w13, w2, weights, experts, b13, b2, activation, 1.702, 1.5,
                                  mxfp4_scales=(s13, s2))
    err = (got.float() - want.float()).abs().max().item()
    return {"shape_ok": list(got.shape) == list(want.shape), "nan": bool(torch.isnan(got).any()),
            "relative_error": err / max(want.float().abs().max().item(), 1e-6)}


def case_poisoned() -> dict:
    tokens, top_k, num_experts, hidden, inter = 21, 2, 4, 64, 96
    x, (w13, s13, w2, s2), b13, b2, weights, experts = inputs(tokens, hidden, inter, num_experts, top_k, True, 3,
                                                              torch.float32)
    block = fused_moe.block_sizes(tokens * top_k, num_experts)
    aligned = fused_moe.align_slots(experts, num_experts, block[0])
    h = torch.full((tokens * top_k, inter), float("nan"))
    fused_moe.gate_up_act(x, w13, b13, aligned, top_k, block, out=h, w13_scales=s13)
    out = torch.full((tokens * top_k, hidden), float("nan"))
    fused_moe.down_weighted(h, w2, b2, weights, aligned, block, out=out, w2_scales=s2)
    return {"h_unwritten": int(torch.isnan(h).any(1).sum()), "out_unwritten": int(torch.isnan(out).any(1).sum())}


def case_engine() -> dict:
    from engine import LLM, SamplingParams
    from engine.layers import moe
    from tests.conftest import hf_greedy
    from tests.quant_helpers import quantize_mxfp4_checkpoint
    from tests.test_gpt_oss import make_gpt_oss_checkpoint
    from tests.test_windowed_families import prompts_of

    calls = []

    def fused_kernels(x, weight, name):
        calls.append(name)
        return fused_moe

    with tempfile.TemporaryDirectory() as tmp:
        float_dir = make_gpt_oss_checkpoint(Path(tmp) / "float", intermediate_size=64)
        reference = quantize_mxfp4_checkpoint(float_dir, Path(tmp) / "mxfp4")
        prompts = prompts_of(4, seed=8, longest=30)
        expected = hf_greedy(reference, prompts, 8)
        moe._kernels_for = fused_kernels
        llm = LLM(str(Path(tmp) / "mxfp4"), device="cpu", kvcache_block_size=8)
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    return {"equal": [o.token_ids for o in outs] == expected, "fused_calls": len(calls)}


CASES = {
    "decode_rows": lambda: case_matches(3, 64, 64, 4, 2),
    "prefill_rows_bias_clamped": lambda: case_matches(37, 96, 64, 6, 3, bias=True, activation="swiglu_clamped"),
    "bf16": lambda: case_matches(19, 64, 96, 4, 2, bias=True, dtype=torch.bfloat16),
    "poisoned": case_poisoned,
    "engine": case_engine,
}


def main() -> None:
    names = sys.argv[1:] or list(CASES)
    print(json.dumps({name: CASES[name]() for name in names}))


if __name__ == "__main__":
    main()
