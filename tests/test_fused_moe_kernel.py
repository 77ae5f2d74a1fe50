"""The fused mixture-of-experts kernels (engine/kernels/fused_moe.py) under the Triton interpreter
(tests/fused_moe_cases.py): the same output as the expert-by-expert reference for one token and many, top-k
from 1 to every expert, biases and gpt-oss's clamped SwiGLU, an expert whose run spans several blocks; every
real slot's row written (NaN-poisoned buffers), the align step's blocks each of one expert, the top-k kernel's
choices torch's, and the engine on these kernels generating transformers' tokens. Each kernel also compiles for
sm_90 as the engine launches it. The GPU's shapes (up to 128 experts, 16k tokens) are in tests/test_gpu_moe.py."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from tests.conftest import kernels_compiled_for_hopper
from tests.interpreter import run_under_interpreter

CASES = Path(__file__).with_name("fused_moe_cases.py")
pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")


@pytest.fixture(scope="module")
def results() -> dict:
    return run_under_interpreter(CASES)


@pytest.mark.parametrize("case", ["one_token_top1", "decode_rows_top2", "prefill_top3_bias",
                                  "skewed_runs_over_several_blocks", "gpt_oss_clamped_swiglu", "all_experts_top_k",
                                  "no_tokens"])
def test_fused_experts_equal_the_reference_in_float32(results, case):
    outcome = results[case]
    assert outcome["shape_ok"] and not outcome["nan"]
    assert outcome["relative_error"] <= 1e-5


def test_fused_experts_in_bfloat16_stay_within_its_rounding(results):
    outcome = results["bf16"]
    assert outcome["shape_ok"] and not outcome["nan"]
    assert outcome["relative_error"] <= 3e-2


def test_every_real_slot_is_written_and_nothing_past_them(results):
    assert results["poisoned"] == {"h_unwritten": 0, "out_unwritten": 0, "tail_untouched": True}


@pytest.mark.parametrize("case", ["alignment", "alignment_of_more_blocks_than_a_chunk"])
def test_align_step_sorts_each_slot_once_into_blocks_of_one_expert(results, case):
    outcome = results[case]
    assert outcome["each_slot_once"] and outcome["blocks_of_one_expert"] and outcome["padding_after_total"]
    assert outcome["total"] == outcome["expected_total"]


@pytest.mark.parametrize("case", ["route_renormalised", "route_raw_odd_experts", "route_top1", "route_top8_of_128",
                                  "route_no_tokens"])
def test_top_k_kernel_picks_torch_experts_and_weights(results, case):
    assert results[case]["experts_equal"]
    assert results[case]["weight_error"] <= 1e-6


@pytest.mark.parametrize("family", ["qwen2_moe", "mixtral"])
def test_engine_on_the_fused_kernels_gives_transformers_greedy_tokens(results, family):
    """The whole engine with its MoE layers on the fused kernels (as on CUDA: top-k, align, both GEMMs; raw
    top-k weights and a shared expert, renormalised ones and a window) generates transformers' tokens."""
    assert results[f"engine_{family}"]["equal"]
    assert results[f"engine_{family}"]["fused_calls"] > 0


@pytest.mark.parametrize("shape", ["qwen3-30b-a3b-decode", "gpt-oss-20b-prefill"])
def test_kernels_compile_for_hopper_as_the_engine_launches_them(shape, monkeypatch):
    """Each kernel of a layer's routing and experts, launched by the wrappers with the GPU's block sizes on the
    shape's bf16 tensors, compiles for sm_90 (bench/kernel_ir.py) within the H100's shared memory."""
    from engine.kernels import fused_moe

    monkeypatch.setattr(fused_moe, "interpreted", lambda: False)  # the GPU's block sizes
    tokens, hidden, inter, num_experts, top_k, bias, activation = {
        "qwen3-30b-a3b-decode": (256, 2048, 768, 128, 8, False, "silu"),
        "gpt-oss-20b-prefill": (2048, 2880, 2880, 32, 4, True, "swiglu_clamped")}[shape]
    bf16 = lambda *s: torch.empty(*s, dtype=torch.bfloat16)  # noqa: E731
    logits, x = bf16(tokens, num_experts), bf16(tokens, hidden)
    w13, w2 = bf16(num_experts, 2 * inter, hidden), bf16(num_experts, hidden, inter)
    b13, b2 = (bf16(num_experts, 2 * inter), bf16(num_experts, hidden)) if bias else (None, None)
    experts = torch.randint(0, num_experts, (tokens, top_k), dtype=torch.int32)
    weights = torch.rand(tokens, top_k)

    def layer():
        fused_moe.route_top_k(logits, top_k, True)
        fused_moe.fused_experts(x, w13, w2, weights, experts, b13, b2, activation)

    assert len(kernels_compiled_for_hopper(layer)) == 6
