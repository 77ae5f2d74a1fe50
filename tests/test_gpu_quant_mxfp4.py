"""MXFP4 experts on the GPU (run on a GPU machine): the fused MoE kernels reading MXFP4 experts
(engine/kernels/fused_moe.py) against the expert-by-expert reference on the dequantized experts over decode and
prefill shapes (gpt-oss-20b's experts; more, narrower ones, as a TP=2 rank holds), into NaN-poisoned buffers;
gpt-oss-20b with dummy MXFP4 experts on one GPU gets at least twice the KV cache of its bf16 run, and generates."""
from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.layers.moe import experts_reference, route
from engine.layers.quant.mxfp4 import dequantize
from tests.quant_helpers import mxfp4_quantize

pytestmark = pytest.mark.gpu
# (tokens, hidden, intermediate, experts, top-k)
SHAPES = [(t, h, i, e, k) for t in (1, 4, 64, 256, 2048)
          for h, i, e, k in ((2880, 2880, 32, 4), (2880, 1440, 64, 4), (1024, 512, 8, 2))]


def _poisoned(monkeypatch):
    from engine.kernels import fused_moe
    original = torch.empty

    def empty(*shape, **kw):  # float buffers (the routing's integer ones hold no values to poison)
        t = original(*shape, **kw)
        return t.fill_(float("nan")) if t.is_floating_point() else t
    monkeypatch.setattr(fused_moe.torch, "empty", empty)


@pytest.mark.parametrize("tokens,hidden,inter,num_experts,top_k", SHAPES,
                         ids=[f"t{t}-h{h}-i{i}-e{e}-k{k}" for t, h, i, e, k in SHAPES])
def test_fused_moe_on_mxfp4_experts_equals_the_dequantized_reference(tokens, hidden, inter, num_experts, top_k,
                                                                       monkeypatch):
    from engine.kernels import fused_moe

    torch.manual_seed(tokens + num_experts)
    w13, s13, _ = mxfp4_quantize(torch.randn(num_experts, 2 * inter, hidden, device="cuda") / hidden ** 0.5)
    w2, s2, _ = mxfp4_quantize(torch.randn(num_experts, hidden, inter, device="cuda") / inter ** 0.5)
    w13, w2 = w13.flatten(2), w2.flatten(2)
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    b13 = torch.randn(num_experts, 2 * inter, device="cuda", dtype=torch.bfloat16)
    b2 = torch.randn(num_experts, hidden, device="cuda", dtype=torch.bfloat16)
    weights, experts = route(torch.randn(tokens, num_experts, device="cuda"), top_k, renormalize=True)
    want = experts_reference(x, dequantize(w13, s13, torch.bfloat16), dequantize(w2, s2, torch.bfloat16), weights,
                             experts, b13, b2, "swiglu_clamped", 1.702, 7.0)
    _poisoned(monkeypatch)
    got = fused_moe.fused_experts(x, w13, w2, weights, experts.to(torch.int32), b13, b2, "swiglu_clamped", 1.702,
                                  7.0, mxfp4_scales=(s13, s2))
    assert not got.isnan().any()
    rel = float((got.float() - want.float()).norm() / want.float().norm())
    assert rel < 2e-2, rel


def test_gpt_oss_20b_in_mxfp4_gives_its_kv_cache_the_memory_its_experts_save(free_gpu):
    """bf16 experts take ~38 GB of gpt-oss-20b's ~42 GB; MXFP4 ones ~10 GB: the KV cache gets what they save (on
    an 80 GB H100 that doubles it; on a 141 GB H200, whose cache is larger to start with, it does not), and the
    MXFP4 model generates."""
    from engine.builtin import BUILTIN_MODELS
    from worker.bench_engine import BENCH_QUANTIZATIONS, quantized_shape

    kv, weights = {}, {}
    for name, model in (("bf16", "gpt-oss-20b"), ("mxfp4", quantized_shape(BUILTIN_MODELS["gpt-oss-20b"],
                                                                            BENCH_QUANTIZATIONS["mxfp4"]))):
        llm = LLM(model, load_format="dummy", max_model_len=4096)
        runner = llm.runner
        kv[name] = runner.num_kvcache_blocks * runner._kv_bytes_per_block()
        weights[name] = sum(t.numel() * t.element_size()
                            for t in [*runner.model.parameters(), *runner.model.buffers()])
        if name == "mxfp4":
            outs = llm.generate([[5, 6, 7, 8]] * 4, SamplingParams(max_tokens=16, ignore_eos=True), use_tqdm=False)
            assert all(len(o.token_ids) == 16 for o in outs)
        llm.shutdown()
    print(f"KV cache bytes: {kv}; weight bytes: {weights}")
    saved = weights["bf16"] - weights["mxfp4"]
    assert saved > 25e9 and kv["mxfp4"] - kv["bf16"] >= 0.9 * saved
