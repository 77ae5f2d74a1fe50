"""Int4 checkpoints (AWQ gemm, GPTQ sym/asym/desc_act, compressed-tensors pack-quantized; engine/layers/quant/int4.py)
and their kernels (engine/kernels/int4_gemm.py).

Kernels under the Triton interpreter (tests/quant_int4_cases.py): the decode GEMV (1 to 16 rows, split-K) and the
prefill GEMM against the dequantized weight in torch, and the engine on them (AWQ, GPTQ desc_act) giving
transformers' tokens, groups of 128 (one per tile) and smaller (per row),
per-channel, biases, fp32 and bf16, every output row written (NaN-poisoned) and nothing past them. Each kernel
also compiles for sm_90 as the wrapper launches it on the Qwen3-8B shape, without a GPU. The packing helpers
invert each other and follow each format's documented layout.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from engine.layers.quant import int4
from tests.conftest import kernels_compiled_for_hopper
from tests.interpreter import run_under_interpreter

CASES = Path(__file__).with_name("quant_int4_cases.py")
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")


def test_int4_packing_round_trips_along_either_dimension_and_in_awq_order():
    values = torch.randint(0, 16, (16, 24), dtype=torch.uint8)
    assert torch.equal(int4.unpack_int4(int4.pack_int4(values, 0), 0), values)
    assert torch.equal(int4.unpack_int4(int4.pack_int4(values, 1), 1), values)
    packed = int4.awq_pack(values)
    assert torch.equal(int4.awq_unpack(packed), values)
    # AWQ: nibble j of each int32 holds column AWQ_ORDER[j] of its eight
    for j, column in enumerate(int4.AWQ_ORDER):
        assert torch.equal((packed[:, 0] >> (4 * j)) & 0xF, values[:, column].int())


def test_gptq_group_order_sorts_act_order_features_and_refuses_unequal_groups():
    g_idx = torch.arange(16) // 4
    assert int4.group_order(g_idx, 4) is None
    shuffled = g_idx[torch.randperm(16, generator=torch.Generator().manual_seed(0))]
    perm = int4.group_order(shuffled, 4)
    assert torch.equal(shuffled[perm], g_idx)
    with pytest.raises(ValueError, match="4 input features in each group"):
        int4.group_order(torch.tensor([0, 0, 0, 1, 1, 1, 1, 1]), 4)


@pytest.fixture(scope="module")
def kernel_results() -> dict:
    return run_under_interpreter(CASES)


@needs_triton
@pytest.mark.parametrize("case", ["gemv_one_row", "gemv_three_rows_bias", "gemv_sixteen_rows_small_groups",
                                  "gemv_per_channel", "gemv_unsplit_bias", "gemm_seventeen_rows",
                                  "gemm_ragged_rows_small_groups"])
def test_int4_kernels_equal_the_dequantized_product_in_float32(kernel_results, case):
    outcome = kernel_results[case]
    assert outcome["unwritten"] == 0 and outcome["tail_untouched"] and outcome["same_storage"]
    assert outcome["relative_error"] <= 1e-5


@needs_triton
@pytest.mark.parametrize("case", ["gemv_bf16", "gemv_one_row_bf16", "gemv_eight_rows_bf16", "gemm_bf16"])
def test_int4_kernels_in_bfloat16_stay_within_its_rounding(kernel_results, case):
    outcome = kernel_results[case]
    assert outcome["unwritten"] == 0 and outcome["tail_untouched"]
    assert outcome["relative_error"] <= 2e-2


@needs_triton
def test_int4_kernels_take_no_rows(kernel_results):
    assert kernel_results["no_rows"]["relative_error"] == 0.0


@needs_triton
@pytest.mark.parametrize("fmt", ["gptq_desc_act", "awq"])
def test_engine_on_the_int4_kernels_under_the_interpreter_gives_transformers_tokens(kernel_results, fmt):
    outcome = kernel_results[f"engine_{fmt}"]
    assert outcome["equal"] and outcome["gemv_calls"] > 0 and outcome["gemm_calls"] > 0


@needs_triton
@pytest.mark.parametrize("rows", [1, 3, 16, 512])
def test_int4_kernels_compile_for_hopper_on_the_8b_shape(rows, monkeypatch):
    """The GEMV (1 and 3 rows on the CUDA cores, 16 on the tensor cores) and the GEMM (512 rows) on Qwen3-8B's
    gate/up projection (K 4096, N 2 x 12288, groups of 128, bf16) compile for sm_90 within the H100's shared memory,
    with the GPU's block sizes."""
    from engine.kernels import int4_gemm

    monkeypatch.setattr(int4_gemm, "interpreted", lambda: False)
    monkeypatch.setattr(int4_gemm, "num_sms", lambda device: 132)
    k, n, group = 4096, 24576, 128
    x = torch.empty(rows, k, dtype=torch.bfloat16)
    qweight = torch.empty(k // 8, n, dtype=torch.int32)
    scales = torch.empty(k // group, n, dtype=torch.float16)
    zeros = torch.empty(k // group, n, dtype=torch.uint8)
    assert len(kernels_compiled_for_hopper(lambda: int4_gemm.int4_linear(x, qweight, scales, zeros, group))) == 1


# ---- checkpoints in each format, through the engine -----------------------------------------------------

PROMPTS = [[5, 17, 230, 41, 9], [300, 12, 77, 401, 2, 60, 18, 250, 3, 99, 140], [7] * 3, list(range(20, 60))]
MAX_NEW = 16


@pytest.fixture(scope="module")
def float_checkpoint(tmp_path_factory) -> Path:
    from tests.conftest import make_checkpoint
    return make_checkpoint("qwen3", tmp_path_factory.mktemp("int4-float"))


def _greedy(model_dir: Path, **kwargs) -> list[list[int]]:
    from engine import LLM, SamplingParams

    llm = LLM(str(model_dir), device="cpu", dtype="float32", kvcache_block_size=8, **kwargs)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_NEW), use_tqdm=False)
    return [o.token_ids for o in outs]


@pytest.mark.parametrize("fmt", ["awq", "gptq-sym", "gptq-asym", "gptq-desc-act", "gptq-v2", "gptq-channel",
                                 "ct-int4-sym", "ct-int4-asym", "ct-int4-channel"])
def test_int4_checkpoint_gives_transformers_tokens_on_its_dequantized_weights(fmt, float_checkpoint, tmp_path):
    """Every decoder projection quantized to int4 in groups of 32, as the format lays its tensors out: the engine
    on the quantized checkpoint generates what transformers generates on the dequantized float weights."""
    from tests.conftest import hf_greedy
    from tests.quant_helpers import quantize_checkpoint

    reference = quantize_checkpoint(float_checkpoint, tmp_path / fmt, fmt)
    assert _greedy(tmp_path / fmt) == hf_greedy(reference, PROMPTS, MAX_NEW)


@pytest.mark.parametrize("fmt,symmetric,strategy", [("ct-int4-sym", True, "group"), ("ct-int4-asym", False, "group"),
                                                     ("ct-int4-channel", False, "channel")])
def test_compressed_tensors_own_decompressor_reads_the_reference_weights(fmt, symmetric, strategy, float_checkpoint,
                                                                         tmp_path):
    """The pack-quantized layout tests/quant_helpers.py writes is the library's: its decompressor gives the
    reference's dequantized weights (rounded to its fp16 scales' dtype, as it computes them)."""
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from safetensors.torch import load_file

    from tests.quant_helpers import quantize_checkpoint

    reference = quantize_checkpoint(float_checkpoint, tmp_path / fmt, fmt)
    packed, want = load_file(tmp_path / fmt / "model.safetensors"), load_file(reference / "model.safetensors")
    args = QuantizationArgs(num_bits=4, type="int", symmetric=symmetric, strategy=strategy,
                            group_size=32 if strategy == "group" else None)
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    for name in ("model.layers.0.mlp.down_proj", "model.layers.1.self_attn.k_proj", "model.layers.1.mlp.gate_proj"):
        tensors = {key[len(name) + 1:]: value for key, value in packed.items() if key.startswith(name + ".")}
        weight = PackedQuantizationCompressor.decompress(tensors, scheme)["weight"]
        assert torch.equal(weight, want[f"{name}.weight"].to(weight.dtype)), name


@pytest.mark.timeout(300)
@pytest.mark.parametrize("fmt", ["awq", "ct-int4-asym", "ct-int4-channel"])
def test_int4_checkpoint_at_tp2_gives_the_same_tokens(fmt, float_checkpoint, tmp_path):
    """Each rank takes its columns of q/k/v and gate/up (zeros unpacked from N-packed words first) and its whole
    groups of o_proj's and down_proj's input features (64 and 128, groups of 32; per channel: every rank its slice
    of the one group, with the whole row of scales)."""
    from engine import LLM, SamplingParams
    from tests.conftest import hf_greedy
    from tests.quant_helpers import quantize_checkpoint
    from tests.test_tp import assert_ranks_gone, generate_ids

    reference = quantize_checkpoint(float_checkpoint, tmp_path / fmt, fmt)
    llm = LLM(str(tmp_path / fmt), device="cpu", dtype="float32", tensor_parallel_size=2, kvcache_block_size=8)
    pids = llm.runner.worker_pids
    try:
        got = generate_ids(llm, PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_NEW))
    finally:
        llm.shutdown()
    assert_ranks_gone(pids)
    assert got == hf_greedy(reference, PROMPTS, MAX_NEW)


def test_tp_size_that_splits_an_int4_group_is_refused_in_one_line(float_checkpoint, tmp_path):
    """Groups of 64 over o_proj's 64 input features: two ranks would take half a group each."""
    from engine import LLM
    from tests.quant_helpers import int4_format, quantize_checkpoint

    quantize_checkpoint(float_checkpoint, tmp_path / "gptq", int4_format("gptq", group_size=64))
    with pytest.raises(ValueError, match=r"^tensor_parallel_size 2 would split the gptq groups of 64[^\n]*$"):
        LLM(str(tmp_path / "gptq"), device="cpu", tensor_parallel_size=2)


def test_gptq_desc_act_at_tp2_is_refused_in_one_line(float_checkpoint, tmp_path):
    from engine import LLM
    from tests.quant_helpers import quantize_checkpoint

    quantize_checkpoint(float_checkpoint, tmp_path / "gptq", "gptq-desc-act")
    with pytest.raises(ValueError, match=r"^gptq desc_act checkpoints run with tensor_parallel_size 1[^\n]*$"):
        LLM(str(tmp_path / "gptq"), device="cpu", tensor_parallel_size=2)


@pytest.mark.parametrize("config, message", [
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, r"awq 4-bit version 'gemv'"),
    ({"quant_method": "gptq", "bits": 8, "group_size": 128}, r"gptq 8-bit checkpoints are not supported"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "checkpoint_format": "marlin"},
     r"gptq checkpoint_format .marlin. is not supported"),
])
def test_unsupported_int4_variants_are_refused_in_one_line(float_checkpoint, tmp_path, config, message):
    import json
    import shutil

    from engine import LLM

    model_dir = tmp_path / "model"
    shutil.copytree(float_checkpoint, model_dir)
    raw = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**raw, "quantization_config": config}))
    with pytest.raises(ValueError, match=rf"^{message}[^\n]*$"):
        LLM(str(model_dir), device="cpu", load_format="dummy")


def test_dummy_int4_weights_are_packed_and_not_zero(float_checkpoint, tmp_path):
    """A shape's config.json with a quantization_config and no weights (the bench's --quantization awq)."""
    import json
    import shutil

    from engine import LLM
    from worker.bench_engine import BENCH_QUANTIZATIONS

    model_dir = tmp_path / "model"
    shutil.copytree(float_checkpoint, model_dir)
    raw = json.loads((model_dir / "config.json").read_text())
    config = {**BENCH_QUANTIZATIONS["awq"], "group_size": 32}
    (model_dir / "config.json").write_text(json.dumps({**raw, "quantization_config": config}))
    llm = LLM(str(model_dir), device="cpu", load_format="dummy", dtype="float32")
    proj = llm.runner.model.model.layers[0].mlp.gate_up_proj
    assert proj.qweight.dtype == torch.int32 and proj.qweight.shape == (64 // 8, 2 * 128)
    weight = int4.dequantize(proj.qweight, proj.scales, proj.zeros, torch.float32)
    assert torch.isfinite(weight).all() and weight.abs().max() > 0
    assert len(_greedy(model_dir, load_format="dummy")[0]) == MAX_NEW
