"""Cases for the fused mixture-of-experts kernels (engine/kernels/fused_moe.py) under the Triton interpreter, each
against the expert-by-expert reference (engine/layers/moe.py experts_reference). Run by
tests/test_fused_moe_kernel.py with TRITON_INTERPRET=1. Prints one JSON object: {case: outcome}.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.kernels import fused_moe  # noqa: E402
from engine.layers.moe import experts_reference, route  # noqa: E402


def inputs(tokens: int, hidden: int, inter: int, num_experts: int, top_k: int, bias: bool, seed: int,
           dtype=torch.float32, skewed: bool = False):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    w13 = (torch.randn(num_experts, 2 * inter, hidden, generator=gen) / hidden ** 0.5).to(dtype)
    w2 = (torch.randn(num_experts, hidden, inter, generator=gen) / inter ** 0.5).to(dtype)
    b13 = torch.randn(num_experts, 2 * inter, generator=gen).to(dtype) if bias else None
    b2 = torch.randn(num_experts, hidden, generator=gen).to(dtype) if bias else None
    logits = torch.randn(tokens, num_experts, generator=gen)
    if skewed:  # most tokens on expert 0: its run spans several blocks, other experts have none
        logits[:, 0] += 6.0
    weights, experts = route(logits, top_k, renormalize=True)
    return x, w13, w2, b13, b2, weights, experts


def case_matches(tokens, hidden, inter, num_experts, top_k, bias=False, activation="silu", dtype=torch.float32,
                 skewed=False, seed=0) -> dict:
    x, w13, w2, b13, b2, weights, experts = inputs(tokens, hidden, inter, num_experts, top_k, bias, seed, dtype, skewed)
    want = experts_reference(x, w13, w2, weights, experts, b13, b2, activation, 1.702, 1.5)
    got = fused_moe.fused_experts(x, w13, w2, weights, experts, b13, b2, activation, 1.702, 1.5)
    err = (got.float() - want.float()).abs().max().item() if tokens else 0.0
    scale = want.float().abs().max().item() if tokens else 1.0
    return {"shape_ok": list(got.shape) == list(want.shape), "relative_error": err / max(scale, 1e-6),
            "nan": bool(torch.isnan(got).any())}


def case_poisoned_outputs_are_written() -> dict:
    """Every real slot's row of h and of the slot outputs is written (buffers pre-filled with NaN), and no
    padded slot writes past them."""
    tokens, top_k, num_experts = 29, 3, 6
    x, w13, w2, b13, b2, weights, experts = inputs(tokens, 40, 24, num_experts, top_k, True, 3, skewed=True)
    block = fused_moe.block_sizes(tokens * top_k, num_experts)
    aligned = fused_moe.align_slots(experts, num_experts, block[0])
    h = torch.full((tokens * top_k + 5, 24), float("nan"))
    fused_moe.gate_up_act(x, w13, b13, aligned, top_k, block, out=h[:tokens * top_k])
    out = torch.full((tokens * top_k + 5, 40), float("nan"))
    fused_moe.down_weighted(h[:tokens * top_k], w2, b2, weights, aligned, block, out=out[:tokens * top_k])
    return {"h_unwritten": int(torch.isnan(h[:tokens * top_k]).any(1).sum()),
            "out_unwritten": int(torch.isnan(out[:tokens * top_k]).any(1).sum()),
            "tail_untouched": bool(torch.isnan(h[tokens * top_k:]).all() and torch.isnan(out[tokens * top_k:]).all())}


def case_alignment(tokens: int) -> dict:
    """Sorted slots: each real slot once, every block one expert's, runs padded to the block."""
    gen = torch.Generator().manual_seed(5)
    experts = torch.stack([torch.randperm(8, generator=gen)[:2] for _ in range(tokens)])
    experts[:20, 0] = 3  # a long run
    experts[experts == 5] = 6  # an expert with no slot between others
    block_m = 16
    sorted_slots, block_experts, num_padded = fused_moe.align_slots(experts, 8, block_m)
    total = int(num_padded.item())
    real = sorted_slots[sorted_slots < experts.numel()].long()
    flat = experts.flatten()
    blocks_ok = all((flat[s.long()] == block_experts[b]).all().item()
                    for b in range(total // block_m)
                    for s in [sorted_slots[b * block_m:(b + 1) * block_m]]
                    for s in [s[s < experts.numel()]])
    counts = torch.bincount(flat, minlength=8)
    return {"each_slot_once": sorted(real.tolist()) == list(range(experts.numel())),
            "blocks_of_one_expert": blocks_ok, "total": total,
            "expected_total": int(((counts + block_m - 1) // block_m * block_m).sum()),
            "padding_after_total": bool((sorted_slots[total:] == experts.numel()).all())}


def case_route(tokens: int, num_experts: int, top_k: int, renormalize: bool) -> dict:
    """The top-k kernel's experts and weights against torch's softmax and topk."""
    logits = torch.randn(tokens, num_experts, generator=torch.Generator().manual_seed(tokens + num_experts)) * 3
    want_w, want_e = route(logits, top_k, renormalize)
    got_w, got_e = fused_moe.route_top_k(logits, top_k, renormalize)
    return {"experts_equal": torch.equal(got_e.long(), want_e),
            "weight_error": (got_w - want_w).abs().max().item() if tokens else 0.0}


def case_engine_tokens(family: str) -> dict:
    """The engine with the MoE layers on the fused kernels (as on CUDA; the other layers in torch) against
    transformers' greedy tokens on a tiny checkpoint of the family."""
    import tempfile

    from engine import LLM, SamplingParams
    from engine.layers import moe
    from tests.conftest import hf_greedy
    from tests.test_moe_families import make_moe_checkpoint
    from tests.test_windowed_families import prompts_of

    used = []

    def fused_kernels(x, weight, name):
        used.append(name)
        return fused_moe

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_moe_checkpoint(family, Path(tmp) / family)
        prompts = prompts_of(6, seed=8, longest=30)
        expected = hf_greedy(model_dir, prompts, 8)
        moe._kernels_for = fused_kernels
        llm = LLM(str(model_dir), device="cpu", kvcache_block_size=8)
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    return {"equal": [o.token_ids for o in outs] == expected, "fused_calls": len(used)}


def main() -> None:
    results = {
        "one_token_top1": case_matches(1, 32, 24, 4, 1),
        "decode_rows_top2": case_matches(5, 48, 40, 8, 2, seed=1),
        "prefill_top3_bias": case_matches(37, 40, 24, 6, 3, bias=True, seed=2),
        "skewed_runs_over_several_blocks": case_matches(45, 32, 24, 8, 2, skewed=True, seed=3),
        "gpt_oss_clamped_swiglu": case_matches(23, 32, 40, 4, 2, bias=True, activation="swiglu_clamped", seed=4),
        "all_experts_top_k": case_matches(9, 32, 16, 4, 4, seed=5),
        "bf16": case_matches(21, 32, 24, 4, 2, dtype=torch.bfloat16, seed=6),
        "no_tokens": case_matches(0, 32, 24, 4, 2),
        "poisoned": case_poisoned_outputs_are_written(),
        "alignment": case_alignment(37),
        "alignment_of_more_blocks_than_a_chunk": case_alignment(700),
        "route_renormalised": case_route(37, 8, 2, True),
        "route_raw_odd_experts": case_route(21, 6, 3, False),
        "route_top1": case_route(5, 60, 1, True),
        "route_top8_of_128": case_route(19, 128, 8, True),
        "route_no_tokens": case_route(0, 8, 2, True),
        **{f"engine_{family}": case_engine_tokens(family) for family in ("qwen2_moe", "mixtral")},
    }
    print(json.dumps(results))


if __name__ == "__main__":
    main()
