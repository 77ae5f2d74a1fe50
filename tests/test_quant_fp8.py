"""fp8 checkpoints (engine/layers/quant/fp8.py) on CPU: tiny Qwen3 and Llama checkpoints written by transformers,
quantized by tests/quant_helpers.py as each format publishes them (block-wise fp8 with shapes no multiple of 128,
per-tensor with dynamic and static activations, compressed-tensors per channel, per tensor and per block, an ignored
layer) give the greedy tokens transformers gives on the dequantized weights, at TP=1 and TP=2 (gloo); the formats'
own readers see the same weights; the weights stay fp8 in memory; a TP size that would split a 128-block and an
unsupported method are refused in one line. The W8A8 kernels (engine/kernels/fp8_gemm.py) run under the Triton
interpreter (tests/fp8_gemm_cases.py), alone and under the whole engine (compressed-tensors' own tokens), and compile
for sm_90 as the engine launches them; their GPU tests are tests/test_gpu_quant_fp8.py."""
from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from engine import LLM, SamplingParams
from tests.conftest import hf_greedy, kernels_compiled_for_hopper, make_checkpoint
from tests.interpreter import run_under_interpreter
from tests.quant_helpers import quantize_checkpoint

PROMPTS = [[5, 17, 33, 9, 100], [7, 8, 9, 10, 11, 12, 13], [300, 2, 41]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12)
# (family, format, ignored modules): intermediate_size 192 puts down_proj's K at one and a half 128-blocks, and
# the tiny q/k/v parts (64, 32, 32 rows) are no multiple of 128
CASES = [
    ("qwen3", "fp8-block", ()),
    ("llama", "fp8-block", ("model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj",
                            "model.layers.0.self_attn.v_proj")),
    ("qwen3", "fp8-tensor", ()),
    ("llama", "fp8-tensor-static", ()),
    ("qwen3", "ct-fp8-channel", ("model.layers.1.mlp.down_proj",)),
    ("llama", "ct-fp8-tensor", ()),
    ("qwen3", "ct-fp8-tensor-static", ()),
    ("llama", "ct-fp8-block", ()),
]


@pytest.fixture(scope="module")
def floats(tmp_path_factory) -> dict:
    return {family: make_checkpoint(family, tmp_path_factory.mktemp(family), intermediate_size=192)
            for family in ("qwen3", "llama")}


def _quantized(floats, tmp_path, family, fmt, ignore=()):
    out = tmp_path / fmt
    reference = quantize_checkpoint(floats[family], out, fmt, ignore)
    return out, reference


def _greedy(model_dir, **kwargs) -> list[list[int]]:
    llm = LLM(str(model_dir), device="cpu", max_model_len=128, **kwargs)
    try:
        return [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    finally:
        llm.shutdown()


@pytest.mark.parametrize("family,fmt,ignore", CASES, ids=[f"{f}-{m}" + ("-ignore" if i else "") for f, m, i in CASES])
def test_quantized_checkpoint_gives_transformers_tokens_on_its_dequantized_weights(floats, tmp_path, family, fmt,
                                                                                 ignore):
    model_dir, reference = _quantized(floats, tmp_path, family, fmt, ignore)
    assert _greedy(model_dir) == hf_greedy(reference, PROMPTS, GREEDY.max_tokens)


def test_weights_stay_fp8_and_dequantize_to_the_reference(floats, tmp_path):
    """The quantized linears hold the checkpoint's fp8 tensors (no float copy); an ignored one stays float; each
    dequantized packed part equals the reference checkpoint's tensor."""
    from engine.config import EngineConfig
    from engine.execution.model_runner import ModelRunner

    model_dir, reference = _quantized(floats, tmp_path, "qwen3", "fp8-block", ("model.layers.1.mlp.down_proj",))
    runner = ModelRunner(EngineConfig(str(model_dir), device="cpu", max_model_len=64), capture_graphs=False)
    layers = runner.model.model.layers
    qkv, down = layers[0].self_attn.qkv_proj, layers[1].mlp.down_proj
    assert qkv.weight.dtype == torch.float8_e4m3fn and qkv.weight_scale_inv.shape == (3, 1)  # one 128-block per part
    assert down.quant is None and down.weight.dtype == torch.float32
    want = load_file(reference / "model.safetensors")
    deq = qkv.quant.dequantized_weight(qkv, torch.float32)
    parts = [want[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv"]
    assert torch.equal(deq, torch.cat(parts))
    gate_up = layers[0].mlp.gate_up_proj
    gate_and_up = [want[f"model.layers.0.mlp.{p}_proj.weight"] for p in ("gate", "up")]
    assert torch.equal(gate_up.quant.dequantized_weight(gate_up, torch.float32), torch.cat(gate_and_up))
    runner.shutdown()


@pytest.mark.parametrize("fmt", ["fp8-block-16", "ct-fp8-channel", "ct-fp8-tensor"])
def test_the_formats_own_readers_see_the_reference_weights(floats, tmp_path, fmt):
    """The layouts tests/quant_helpers.py writes are the published ones: transformers (its fine-grained fp8
    quantizer; compressed-tensors' library) reads each quantized linear as the reference's dequantized weight,
    and the ignored one as its float weight."""
    from transformers import AutoModelForCausalLM

    if fmt.startswith("ct-"):
        pytest.importorskip("compressed_tensors")
    ignored = "model.layers.1.mlp.down_proj"
    model_dir, reference = _quantized(floats, tmp_path, "qwen3", fmt, (ignored,))
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    want = load_file(reference / "model.safetensors")
    checked = 0
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] not in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                           "down_proj"):
            continue
        weight = module.weight.float()
        if weight.dtype != module.weight.dtype:  # kept in fp8 (compressed-tensors): times its scale
            assert name != ignored
            weight = weight * module.weight_scale.float().reshape(-1, 1)
        assert torch.equal(weight, want[name + ".weight"]), name
        checked += 1
    assert checked == 14


@pytest.mark.parametrize("fmt", ["fp8-block-16", "ct-fp8-channel", "fp8-tensor"])
def test_tensor_parallel_ranks_give_the_single_rank_tokens(floats, tmp_path, fmt):
    """TP=2 on gloo: each rank's slice of the weights and of their block / channel / per-part scales."""
    model_dir, reference = _quantized(floats, tmp_path, "qwen3", fmt)
    assert _greedy(model_dir, tensor_parallel_size=2) == hf_greedy(reference, PROMPTS, GREEDY.max_tokens)


def test_tensor_parallel_size_that_splits_a_block_is_refused_in_one_line(floats, tmp_path):
    model_dir, _ = _quantized(floats, tmp_path, "qwen3", "fp8-block")
    with pytest.raises(ValueError, match=r"^tensor_parallel_size 2 would split the fp8 weight blocks of 128[^\n]*$"):
        _greedy(model_dir, tensor_parallel_size=2)


def test_dummy_weights_of_a_quantized_config_generate(floats, tmp_path):
    """load_format='dummy' (benchmarks): random fp8 weights with unit scales."""
    model_dir, _ = _quantized(floats, tmp_path, "qwen3", "fp8-block")
    for f in model_dir.glob("*.safetensors"):
        f.unlink()
    outs = _greedy(model_dir, load_format="dummy")
    assert [len(o) for o in outs] == [GREEDY.max_tokens] * len(PROMPTS)


@pytest.mark.parametrize("quantization,named", [
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "bitsandbytes"),
    ({"load_in_8bit": True}, "bitsandbytes"),
    ({"quant_method": "hqq"}, "hqq"),
    ({"quant_method": "compressed-tensors", "format": "int-quantized"}, "compressed-tensors, format int-quantized"),
])
def test_unsupported_method_is_refused_in_one_line_naming_it(floats, tmp_path, quantization, named):
    model_dir = tmp_path / "unsupported"
    shutil.copytree(floats["qwen3"], model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "quantization_config": quantization}))
    with pytest.raises(ValueError) as e:
        LLM(str(model_dir), device="cpu")
    message = str(e.value)
    assert "\n" not in message and f"quantized ({named})" in message
    assert ("supported: fp8" in message) or ("supported compressed-tensors formats: float-quantized" in message)


def test_compressed_tensors_int8_weights_are_refused_in_one_line(floats, tmp_path):
    from engine.layers.quant import parse_quantization
    from tests.quant_helpers import compressed_tensors_fp8_format

    config = compressed_tensors_fp8_format("channel").quantization_config([])
    config["config_groups"]["group_0"]["weights"].update(num_bits=8, type="int")
    with pytest.raises(ValueError, match=r"^compressed-tensors float-quantized weights of 8 bits, type 'int'"):
        parse_quantization({"quantization_config": config})


# ---- the kernels ------------------------------------------------------------------------------------------

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")


@pytest.fixture(scope="module")
def kernel_results() -> dict:
    return run_under_interpreter(Path(__file__).with_name("fp8_gemm_cases.py"))


@needs_triton
@pytest.mark.parametrize("case", ["quantize_group_128", "quantize_row"])
def test_activation_quantization_gives_torch_scales_and_values(kernel_results, case):
    assert kernel_results[case]["scale_err"] < 1e-6
    assert kernel_results[case]["values_differing"] == 0


@needs_triton
@pytest.mark.parametrize("case", ["block_decode_packed", "block_prefill_bias", "block_mid_rows", "channel_decode",
                                  "channel_prefill_bias", "channel_static"])
def test_gemm_equals_the_dequantized_product_and_writes_every_output(kernel_results, case):
    assert kernel_results[case]["rel_err"] < 1e-5
    assert not kernel_results[case]["nan"]


@needs_triton
@pytest.mark.parametrize("case", ["linear_block_fp32", "linear_block_bf16", "linear_channel_fp32"])
def test_w8a8_linear_is_the_product_of_fp8_activations(kernel_results, case):
    """Against torch's own fp8 rounding of the activations: exact up to accumulation order (bf16: its rounding);
    against the float activations, within fp8's rounding."""
    result = kernel_results[case]
    assert result["emulated_rel_err"] < (1e-2 if "bf16" in case else 1e-5)
    assert result["rel_err"] < 0.06


@needs_triton
@pytest.mark.parametrize("fmt", ["ct-fp8-channel", "ct-fp8-block"])
def test_engine_on_the_w8a8_kernels_gives_compressed_tensors_own_tokens(fmt):
    """The engine's projections on the kernels (as on CUDA) quantize the activations as compressed-tensors' own
    forward does (per token; per group of 128 beside block scales): transformers' greedy tokens through it."""
    pytest.importorskip("compressed_tensors")
    result = run_under_interpreter(Path(__file__).with_name("fp8_gemm_cases.py"), fmt)[fmt]
    assert result["equal"] and result["kernel_calls"] > 0


@needs_triton
def test_no_rows_give_an_empty_output(kernel_results):
    assert kernel_results["no_rows"]["shape"] == [0, 32]


@needs_triton
@pytest.mark.parametrize("rows", [1, 48, 100, 2048])
@pytest.mark.parametrize("blockwise", [True, False])
def test_kernels_compile_for_hopper_on_the_8b_shape(rows, blockwise):
    """Both kernels, launched by the wrappers on Qwen3-8B's gate/up projection (K 4096, N 24576) in bf16, compile for
    sm_90 (bench/kernel_ir.py) within the H100's shared memory."""
    from engine.kernels import fp8_gemm

    x = torch.empty(rows, 4096, dtype=torch.bfloat16)
    w = torch.empty(24576, 4096, dtype=torch.float8_e4m3fn)

    def project():
        if blockwise:
            fp8_gemm.fp8_block_linear(x, w, torch.empty(192, 32), torch.zeros(24576, dtype=torch.int32), 128)
        else:
            fp8_gemm.fp8_channel_linear(x, w, torch.empty(24576))
    assert len(kernels_compiled_for_hopper(project)) == 2


# ---- the bench's quantized dummy weights -------------------------------------------------------------------

def test_bench_runs_a_shipped_shape_with_dummy_fp8_weights(capsys):
    """`--quantization fp8` gives the shape Qwen3-*-FP8's quantization_config and random fp8 weights."""
    from engine.builtin import TINY_MODEL_DIR
    from worker import bench_engine as bench

    parser = bench.argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args(["--model", str(TINY_MODEL_DIR), "--num-seqs", "3", "--min-input-len", "5",
                              "--max-input-len", "20", "--min-output-len", "2", "--max-output-len", "6",
                              "--max-token-id", "500", "--device", "cpu", "--max-model-len", "64",
                              "--quantization", "fp8"])
    llm = bench.build_llm(args)
    qkv = llm.runner.model.model.layers[0].self_attn.qkv_proj
    assert qkv.weight.dtype == torch.float8_e4m3fn and qkv.quant.weight_block == (128, 128)
    llm.shutdown()
    record = bench.run(args)
    _, params = bench.make_workload(args)
    assert record["quantization"] == "fp8" and record["tokens"] == sum(sp.max_tokens for sp in params)
    with pytest.raises(ValueError, match="^--quantization makes quantized dummy weights"):
        bench.check_arguments(parser.parse_args(["--model", "tiny", "--load-format", "auto", "--quantization", "fp8"]))
