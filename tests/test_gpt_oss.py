"""gpt-oss against transformers on a tiny checkpoint that transformers writes (alternating sliding-window and full
layers with windows shorter than the prompts, attention sinks, YaRN rope, 8 experts top-2 with biases and the
clamped SwiGLU): greedy tokens equal transformers' generate, also through prefix-cache hits, forced preemption,
chunked prefill and TP=2, and with the attention and the experts on the GPU's Triton kernels (run by the
interpreter); YaRN's tables equal transformers'. MXFP4 checkpoints: tests/test_quant_mxfp4.py."""
from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.builtin import TINY_MODEL_DIR
from engine.layers import moe
from tests.conftest import hf_greedy, watch_chunks
from tests.interpreter import run_under_interpreter
from tests.test_tp import assert_ranks_gone, generate_ids
from tests.test_windowed_families import prompts_of

MAX_NEW = 20
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW)
NUM_EXPERTS = 8
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
        "truncate": False, "original_max_position_embeddings": 512}


def make_gpt_oss_checkpoint(out_dir: Path, seed: int = 0, **overrides) -> Path:
    """save_pretrained a tiny random gpt-oss (sliding window 10, then a full layer; 8 experts, top-2) with the tiny
    model's tokenizer. Sinks, router and expert biases are drawn larger than transformers' init so they matter."""
    import transformers as tf

    config = tf.GptOssConfig(**{
        "vocab_size": 512, "hidden_size": 64, "intermediate_size": 32, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_local_experts": NUM_EXPERTS,
        "num_experts_per_tok": 2, "sliding_window": 10, "max_position_embeddings": 2048, "rope_parameters": YARN,
        "rms_norm_eps": 1e-6, "eos_token_id": 2, "pad_token_id": 0, "bos_token_id": None, "initializer_range": 0.2,
        "swiglu_limit": 1.0, **overrides})
    torch.manual_seed(seed)
    model = tf.GptOssForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("sinks", "router.bias", "_proj_bias")):
                param.normal_(0.0, 1.0)
    model.save_pretrained(out_dir, safe_serialization=True)
    for f in Path(TINY_MODEL_DIR).iterdir():
        if f.name != "config.json":
            shutil.copy(f, out_dir / f.name)
    return out_dir


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The checkpoint, prompts (most longer than the window; six sharing a 40-token prefix) and transformers'
    greedy completions."""
    model_dir = make_gpt_oss_checkpoint(tmp_path_factory.mktemp("gpt-oss"))
    prompts = prompts_of(10) + prompts_of(6, shared_prefix=40, seed=2)
    return model_dir, prompts, hf_greedy(model_dir, prompts, MAX_NEW)


def test_greedy_tokens_match_transformers_with_sinks_windows_and_experts_that_matter(reference, monkeypatch):
    model_dir, prompts, expected = reference
    chosen = []
    route = moe.route

    def spy(logits, top_k, renormalize):
        weights, experts = route(logits, top_k, renormalize)
        chosen.append(experts.clone())
        return weights, experts

    monkeypatch.setattr(moe, "route", spy)
    llm = LLM(str(model_dir), device="cpu", kvcache_block_size=8)
    assert [layer.self_attn.attn.window for layer in llm.runner.model.model.layers] == [10, 0]
    assert generate_ids(llm, prompts, GREEDY) == expected
    # the premises: every expert serves tokens, a prefill step uses several, the prompts outrun the window
    assert set(torch.cat([c.flatten() for c in chosen]).tolist()) == set(range(NUM_EXPERTS))
    assert max(len(set(c.flatten().tolist())) for c in chosen) >= 6
    assert sum(len(p) > 10 for p in prompts) >= 10


def test_sinks_are_loaded_and_change_the_tokens(reference):
    """The premise of the comparison: with the sinks zeroed (each still one softmax column), the tokens differ."""
    model_dir, prompts, expected = reference
    llm = LLM(str(model_dir), device="cpu", kvcache_block_size=8)
    sinks = [layer.self_attn.sinks for layer in llm.runner.model.model.layers]
    assert all(s.abs().max() > 0.1 for s in sinks)
    for s in sinks:
        s.data.fill_(-1e4)  # a sink that takes no mass: plain attention
    assert generate_ids(llm, prompts, GREEDY) != expected


def test_prefix_cache_preemption_and_chunked_prefill_keep_tokens_identical(reference):
    model_dir, prompts, expected = reference
    llm = LLM(str(model_dir), device="cpu", kvcache_block_size=4, num_kvcache_blocks=40, max_model_len=128,
              max_num_batched_tokens=24)
    chunked = watch_chunks(llm)
    assert generate_ids(llm, prompts + prompts[-6:], GREEDY) == expected + expected[-6:]
    assert chunked, "no prompt was split into chunks"
    assert llm.scheduler.num_preemptions > 0
    assert llm.block_manager.num_cache_hits > 0


@pytest.mark.timeout(300)
def test_tp2_splits_heads_sinks_and_experts_and_keeps_transformers_tokens(reference):
    model_dir, prompts, expected = reference
    llm = LLM(str(model_dir), device="cpu", tensor_parallel_size=2, kvcache_block_size=4, num_kvcache_blocks=40,
              max_model_len=128, max_num_batched_tokens=32)
    pids = llm.runner.worker_pids
    try:
        assert generate_ids(llm, prompts + prompts[-4:], GREEDY) == expected + expected[-4:]
        assert llm.scheduler.num_preemptions > 0
        assert llm.block_manager.num_cache_hits > 0
    finally:
        llm.shutdown()
    assert_ranks_gone(pids)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_engine_on_the_gpu_kernels_under_the_interpreter_gives_transformers_tokens():
    """The attention through the triton backend (qkv_prep, prefill, split-KV and fused decode, with sinks and the
    window) and the MoE layers through the fused kernels, as on CUDA, run by the Triton interpreter."""
    results = run_under_interpreter(Path(__file__).parent / "engine_on_kernels_cases.py", "gpt_oss")["gpt_oss"]
    assert results["equal"], results
    assert results["moe_calls"] > 0 and results["fused_decode_calls"] > 0 and results["prefill_calls"] > 0


@pytest.mark.parametrize("rope", [YARN, {**YARN, "truncate": True, "beta_fast": 16.0, "beta_slow": 2.0,
                                          "factor": 8.0, "rope_theta": 150000.0}])
def test_yarn_tables_equal_transformers(rope):
    import transformers as tf
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRotaryEmbedding

    from engine.layers.rotary import RotaryEmbedding, rope_settings

    config = tf.GptOssConfig(num_hidden_layers=2, hidden_size=64, head_dim=32, num_attention_heads=4,
                             num_key_value_heads=2, max_position_embeddings=4096, rope_parameters=dict(rope))
    hf = GptOssRotaryEmbedding(config)
    ours = RotaryEmbedding(32, 4096, *rope_settings(config))
    cos, sin = hf(torch.zeros(1), torch.arange(4096)[None])
    assert hf.attention_scaling > 1.1  # the premise: the attention factor scales the tables
    torch.testing.assert_close(ours.cos, cos[0], rtol=0, atol=0)
    torch.testing.assert_close(ours.sin, sin[0], rtol=0, atol=0)


def test_shipped_gpt_oss_20b_shape_alternates_windows_and_keeps_its_yarn():
    from engine.config import EngineConfig
    from engine.models import model_class

    config = EngineConfig("gpt-oss-20b", load_format="dummy", device="cpu")
    hf = config.hf_config
    assert model_class(hf.architectures).__name__ == "GptOssForCausalLM"
    assert (hf.num_local_experts, hf.num_experts_per_tok, hf.num_hidden_layers, hf.head_dim) == (32, 4, 24, 64)
    assert model_class(hf.architectures).layer_windows(hf) == [128, 0] * 12
    assert hf.rope_parameters["rope_type"] == "yarn" and hf.rope_parameters["factor"] == 32.0
