"""gpt-oss with MXFP4 experts, as OpenAI publishes it (engine/layers/quant/mxfp4.py): a tiny gpt-oss written by
transformers, its experts quantized by tests/quant_helpers.py into gate_up_proj_blocks/_scales and
down_proj_blocks/_scales (which transformers' own MXFP4 dequantizer reads as the reference experts); the engine
loads them packed and generates transformers' greedy tokens on the dequantized weights, on CPU (dequantized per
forward), at TP=2 (each rank its blocks of the intermediate features) and with the fused MoE kernels reading the
packed experts under the Triton interpreter (tests/quant_mxfp4_cases.py, which also checks the kernels against the
dequantized reference into NaN-poisoned buffers). A tensor_parallel_size that would split a block of 32 is refused
in one line; dummy MXFP4 experts load from config.json alone; the kernels compile for sm_90 on gpt-oss-20b's
shapes."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from tests.conftest import hf_greedy, kernels_compiled_for_hopper
from tests.interpreter import run_under_interpreter
from tests.quant_helpers import quantize_mxfp4_checkpoint
from tests.test_gpt_oss import make_gpt_oss_checkpoint
from tests.test_tp import assert_ranks_gone, generate_ids
from tests.test_windowed_families import prompts_of

MAX_NEW = 16
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW)
CASES = Path(__file__).with_name("quant_mxfp4_cases.py")
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")


@pytest.fixture(scope="module")
def mxfp4(tmp_path_factory):
    """(the MXFP4 checkpoint, prompts, transformers' greedy tokens on its dequantized weights). Intermediate size
    64: two blocks of 32, one a rank at TP=2."""
    root = tmp_path_factory.mktemp("gpt-oss-mxfp4")
    float_dir = make_gpt_oss_checkpoint(root / "float", intermediate_size=64)
    reference = quantize_mxfp4_checkpoint(float_dir, root / "mxfp4")
    prompts = prompts_of(6)
    return root / "mxfp4", prompts, hf_greedy(reference, prompts, MAX_NEW)


def test_transformers_own_mxfp4_reader_sees_the_reference_experts(mxfp4):
    """The blocks and scales tests/quant_helpers.py writes are OpenAI's layout: transformers' MXFP4 dequantizer
    (integrations/mxfp4.py) turns them into the reference checkpoint's gate_up_proj and down_proj."""
    from safetensors.torch import load_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    model_dir, _, _ = mxfp4
    packed = load_file(model_dir / "model.safetensors")
    want = load_file(Path(str(model_dir) + "-dequantized") / "model.safetensors")
    for layer in range(2):
        for proj in ("gate_up_proj", "down_proj"):
            name = f"model.layers.{layer}.mlp.experts.{proj}"
            got = convert_moe_packed_tensors(packed[f"{name}_blocks"], packed[f"{name}_scales"], dtype=torch.float32)
            assert torch.equal(got, want[name]), name


def test_mxfp4_gpt_oss_gives_transformers_tokens_on_its_dequantized_experts(mxfp4):
    model_dir, prompts, expected = mxfp4
    llm = LLM(str(model_dir), device="cpu", kvcache_block_size=4, max_model_len=128)
    experts = llm.runner.model.model.layers[0].mlp.experts
    assert experts.w13_blocks.dtype == torch.uint8 and experts.w13 is None  # kept packed
    assert generate_ids(llm, prompts, GREEDY) == expected


@pytest.mark.timeout(300)
def test_mxfp4_experts_split_in_whole_blocks_at_tp2(mxfp4):
    model_dir, prompts, expected = mxfp4
    llm = LLM(str(model_dir), device="cpu", tensor_parallel_size=2, kvcache_block_size=4, max_model_len=128)
    pids = llm.runner.worker_pids
    try:
        assert generate_ids(llm, prompts, GREEDY) == expected
    finally:
        llm.shutdown()
    assert_ranks_gone(pids)


def test_tp_size_that_splits_an_mxfp4_block_is_refused_in_one_line(tmp_path):
    float_dir = make_gpt_oss_checkpoint(tmp_path / "float")  # intermediate size 32: one block
    quantize_mxfp4_checkpoint(float_dir, tmp_path / "mxfp4")
    with pytest.raises(ValueError, match=r"^tensor_parallel_size 2 would split the MXFP4 blocks of 32[^\n]*$"):
        LLM(str(tmp_path / "mxfp4"), device="cpu", tensor_parallel_size=2)


def test_dummy_mxfp4_experts_load_from_the_config_alone(tmp_path):
    """The shipped gpt-oss-20b-mxfp4 shape's way: a config.json with the published quantization_config and no
    weights (here a tiny one); the experts are packed, their dummy values finite and not all zero."""
    float_dir = make_gpt_oss_checkpoint(tmp_path / "float", intermediate_size=64)
    config = json.loads((float_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["lm_head"]}
    (float_dir / "config.json").write_text(json.dumps(config))
    llm = LLM(str(float_dir), device="cpu", load_format="dummy", max_model_len=64)
    experts = llm.runner.model.model.layers[0].mlp.experts
    w13, w2 = experts.quant.dequantized(experts, torch.float32)
    assert torch.isfinite(w13).all() and w13.abs().max() > 0 and w2.abs().max() > 0
    assert len(generate_ids(llm, [[5, 6, 7]], GREEDY)[0]) == MAX_NEW


def test_the_float_experts_mxfp4_replaces_are_freed_at_once():
    """quantize() drops the float w13/w2 with their last reference, not at the garbage collector's next run: on a
    GPU the KV cache is sized right after the model is built, and gpt-oss-20b's float experts are 38 GB."""
    import gc
    import weakref

    from engine.layers.moe import ExpertWeights
    from engine.layers.parallel import SINGLE
    from engine.layers.quant.mxfp4 import Mxfp4Method

    experts = ExpertWeights(num_experts=4, hidden_size=64, intermediate_size=64, bias=True, tp=SINGLE)
    floats = [weakref.ref(experts.w13), weakref.ref(experts.w2)]
    gc.disable()
    try:
        experts.quantize(Mxfp4Method({"quant_method": "mxfp4"}))
        assert [ref() for ref in floats] == [None, None]
    finally:
        gc.enable()
    assert experts.w13_blocks.dtype == torch.uint8


@pytest.fixture(scope="module")
def kernel_results() -> dict:
    return run_under_interpreter(CASES)


@needs_triton
@pytest.mark.parametrize("case", ["decode_rows", "prefill_rows_bias_clamped", "bf16"])
def test_fused_moe_kernels_on_mxfp4_experts_equal_the_dequantized_reference(kernel_results, case):
    outcome = kernel_results[case]
    assert outcome["shape_ok"] and not outcome["nan"]
    assert outcome["relative_error"] <= (3e-2 if case == "bf16" else 1e-5)


@needs_triton
def test_mxfp4_kernels_write_every_real_slot(kernel_results):
    assert kernel_results["poisoned"] == {"h_unwritten": 0, "out_unwritten": 0}


@needs_triton
def test_mxfp4_gpt_oss_on_the_fused_kernels_under_the_interpreter_gives_transformers_tokens(kernel_results):
    assert kernel_results["engine"]["equal"] and kernel_results["engine"]["fused_calls"] > 0


@needs_triton
def test_mxfp4_moe_kernels_compile_for_hopper_on_the_gpt_oss_20b_shape(monkeypatch):
    """Both expert GEMMs on MXFP4 experts (gpt-oss-20b: 32 experts, hidden and intermediate 2880, top-4, biases,
    the clamped SwiGLU, 2048 prefill tokens) compile for sm_90 within the H100's shared memory."""
    from engine.kernels import fused_moe

    monkeypatch.setattr(fused_moe, "interpreted", lambda: False)
    tokens, hidden, inter, num_experts, top_k = 2048, 2880, 2880, 32, 4
    bf16 = lambda *s: torch.empty(*s, dtype=torch.bfloat16)  # noqa: E731
    u8 = lambda *s: torch.empty(*s, dtype=torch.uint8)  # noqa: E731
    x = bf16(tokens, hidden)
    w13, s13 = u8(num_experts, 2 * inter, hidden // 2), u8(num_experts, 2 * inter, hidden // 32)
    w2, s2 = u8(num_experts, hidden, inter // 2), u8(num_experts, hidden, inter // 32)
    experts = torch.randint(0, num_experts, (tokens, top_k), dtype=torch.int32)
    gemms = kernels_compiled_for_hopper(lambda: fused_moe.fused_experts(
        x, w13, w2, torch.rand(tokens, top_k), experts, bf16(num_experts, 2 * inter), bf16(num_experts, hidden),
        "swiglu_clamped", mxfp4_scales=(s13, s2)), names=("_gate_up_act_kernel", "_down_weighted_kernel"))
    assert len(gemms) == 2
