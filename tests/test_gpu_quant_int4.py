"""Int4 checkpoints on the GPU (run on a GPU machine): the W4A16 kernels (engine/kernels/int4_gemm.py: the decode
GEMV up to 16 rows, the prefill GEMM past them) against torch's product with the dequantized weight over many
shapes (Qwen3-8B's projections, groups of 128 and 32, per-channel, odd N) into NaN-poisoned outputs; the prompt
logits of AWQ, GPTQ desc_act and compressed-tensors checkpoints against their dequantized bf16 runs; decode graphs
giving eager's tokens. Speed (batch 1 on the 8B shape, int4 against bf16) is measured by the bench, not here:
docs/quantization.md gives the commands."""
from __future__ import annotations

import pytest
import torch

from engine.layers.quant.int4 import dequantize, pack_int4
from tests.conftest import make_checkpoint
from tests.quant_helpers import (against_dequantized, assert_graph_tokens_score_as_eager, int4_format, kv_cache_bytes,
                                  quantize_checkpoint, random_prompts)

pytestmark = pytest.mark.gpu
# (rows, N, K, group): decode rows (GEMV) and prefill rows (GEMM) on Qwen3-8B's qkv, o, gate/up and down; small
# groups and one group per channel; an N no multiple of the tiles
SHAPES = [(m, n, k, g) for m in (1, 2, 4, 7, 16, 17, 64, 300, 2048)
          for n, k, g in ((6144, 4096, 128), (4096, 4096, 128), (24576, 4096, 128), (4096, 12288, 128),
                          (4096, 4096, 32), (1000, 512, 512))]


def _poisoned(monkeypatch):
    from engine.kernels import int4_gemm
    original = torch.empty

    def empty(*shape, **kw):
        return original(*shape, **kw).fill_(float("nan"))
    monkeypatch.setattr(int4_gemm.torch, "empty", empty)


@pytest.mark.parametrize("rows,n,k,group", SHAPES, ids=[f"m{m}-n{n}-k{k}-g{g}" for m, n, k, g in SHAPES])
def test_w4a16_kernels_equal_torch_on_the_dequantized_weight(rows, n, k, group, monkeypatch):
    from engine.kernels import int4_gemm

    gen = torch.Generator(device="cuda").manual_seed(rows + n + k)
    q = torch.randint(0, 16, (k, n), device="cuda", dtype=torch.uint8, generator=gen)
    zeros = torch.randint(0, 16, (k // group, n), device="cuda", dtype=torch.uint8, generator=gen)
    scales = (torch.rand(k // group, n, device="cuda", generator=gen) * 0.02 + 0.001).half()
    qweight = pack_int4(q, 0)
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16, generator=gen)
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16, generator=gen) if rows % 2 else None
    _poisoned(monkeypatch)
    out = int4_gemm.int4_linear(x, qweight, scales, zeros, group, bias)
    want = x.float() @ dequantize(qweight, scales, zeros, torch.bfloat16).float()
    if bias is not None:
        want += bias.float()
    assert out.dtype == torch.bfloat16 and out.shape == (rows, n) and not out.isnan().any()
    rel = float((out.float() - want).norm() / want.norm())
    assert rel < 1e-2, rel


@pytest.fixture(scope="module")
def int4_checkpoints(tmp_path_factory) -> dict:
    """A Qwen3 checkpoint of real head sizes written by transformers, in AWQ, GPTQ desc_act and compressed-tensors
    (symmetric) int4 in groups of 128, with the dequantized references."""
    base = make_checkpoint("qwen3", tmp_path_factory.mktemp("gpu-int4"), hidden_size=1024, intermediate_size=3072,
                           num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4, head_dim=128,
                           initializer_range=0.05)
    formats = {"awq": int4_format("awq", group_size=128),
               "gptq-desc-act": int4_format("gptq", group_size=128, desc_act=True),
               "ct-int4-sym": int4_format("compressed-tensors", group_size=128, sym=True)}
    out = {}
    for name, fmt in formats.items():
        model_dir = tmp_path_factory.mktemp(name) / name
        out[name] = (model_dir, quantize_checkpoint(base, model_dir, fmt))
    return out


@pytest.mark.parametrize("fmt", ["awq", "gptq-desc-act", "ct-int4-sym"])
def test_prompt_logits_equal_the_dequantized_bf16_run(int4_checkpoints, fmt, free_gpu):
    """The weights are the same values in both runs (int4 x scale, rounded to bf16 as the GEMM's tiles are): only
    the sums' order and the GEMV's float32 weights separate them."""
    model_dir, reference = int4_checkpoints[fmt]
    errors, same_top, total = against_dequantized(model_dir, reference, random_prompts(4, 1))
    print(f"{fmt}: relative logit error {errors}, same top token {same_top}/{total}")
    assert max(errors) < 0.03 and same_top >= 0.95 * total


def test_decode_graphs_choose_the_tokens_eager_steps_score_best(int4_checkpoints, free_gpu):
    model_dir, _ = int4_checkpoints["gptq-desc-act"]
    assert_graph_tokens_score_as_eager(model_dir, random_prompts(8, 2))


def test_the_8b_shape_in_int4_gives_its_kv_cache_the_memory_its_weights_save(free_gpu):
    """Qwen3-8B's linears hold ~6.9e9 weights: in int4 (groups of 128) they take ~3.6 GB instead of ~13.9 GB."""
    sizes = {"bf16": kv_cache_bytes("qwen3-8b"), "awq": kv_cache_bytes("qwen3-8b", "awq")}
    print(f"KV cache bytes: {sizes}")
    assert sizes["awq"] - sizes["bf16"] > 9e9
