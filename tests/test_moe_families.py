"""Qwen3-MoE, Qwen2-MoE and Mixtral against transformers on the same tiny checkpoints (8 experts, top-2, routing
that spreads the prompts' tokens over the experts): greedy tokens equal transformers' generate, also through
prefix-cache hits, forced preemption, chunked prefill and TP=2; the expert layer loads every checkpoint layout
(per-expert tensors, gpt-oss's fused and interleaved one) and splits experts across ranks exactly."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.builtin import TINY_MODEL_DIR
from engine.layers import moe
from tests.conftest import hf_greedy, preempt_every, watch_chunks
from tests.test_tp import assert_ranks_gone, generate_ids
from tests.test_windowed_families import prompts_of

MAX_NEW = 20
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW)
MOE_FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral")
NUM_EXPERTS = 8


def make_moe_checkpoint(family: str, out_dir: Path, seed: int = 0, **overrides) -> Path:
    """save_pretrained a tiny random MoE model of `family` (8 experts, top-2) with the tiny model's tokenizer."""
    import transformers as tf

    common = dict(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=2048, rms_norm_eps=1e-6, eos_token_id=2, pad_token_id=0, bos_token_id=None,
                  initializer_range=0.2, tie_word_embeddings=False, num_experts_per_tok=2)
    if family == "qwen3_moe":  # renormalised top-k weights
        config = tf.Qwen3MoeConfig(**{**common, "head_dim": 16, "intermediate_size": 128, "moe_intermediate_size": 32,
                                      "num_experts": NUM_EXPERTS, "norm_topk_prob": True, **overrides})
        cls = tf.Qwen3MoeForCausalLM
    elif family == "qwen2_moe":  # raw top-k weights, a shared expert
        config = tf.Qwen2MoeConfig(**{**common, "intermediate_size": 128, "moe_intermediate_size": 32,
                                      "shared_expert_intermediate_size": 48, "num_experts": NUM_EXPERTS,
                                      "norm_topk_prob": False, **overrides})
        cls = tf.Qwen2MoeForCausalLM
    elif family == "mixtral":  # a sliding window shorter than most prompts
        config = tf.MixtralConfig(**{**common, "intermediate_size": 32, "num_local_experts": NUM_EXPERTS,
                                     "sliding_window": 12, **overrides})
        cls = tf.MixtralForCausalLM
    else:
        raise ValueError(family)
    torch.manual_seed(seed)
    cls(config).eval().save_pretrained(out_dir, safe_serialization=True)
    for f in Path(TINY_MODEL_DIR).iterdir():
        if f.name != "config.json":
            shutil.copy(f, out_dir / f.name)
    return out_dir


@pytest.fixture(scope="module", params=MOE_FAMILIES)
def reference(request, tmp_path_factory):
    """A checkpoint of the family, prompts (six sharing a 40-token prefix) and transformers' greedy completions."""
    model_dir = make_moe_checkpoint(request.param, tmp_path_factory.mktemp(request.param))
    prompts = prompts_of(10) + prompts_of(6, shared_prefix=40, seed=2)
    return model_dir, prompts, hf_greedy(model_dir, prompts, MAX_NEW)


def test_greedy_tokens_match_transformers_with_tokens_spread_over_the_experts(reference, monkeypatch):
    model_dir, prompts, expected = reference
    chosen = []
    route = moe.route

    def spy(logits, top_k, renormalize):
        weights, experts = route(logits, top_k, renormalize)
        chosen.append(experts.clone())
        return weights, experts

    monkeypatch.setattr(moe, "route", spy)
    llm = LLM(str(model_dir), device="cpu", kvcache_block_size=8)
    assert generate_ids(llm, prompts, GREEDY) == expected
    # the premise: routing is not degenerate, every expert serves tokens and a prefill step uses several
    assert set(torch.cat([c.flatten() for c in chosen]).tolist()) == set(range(NUM_EXPERTS))
    assert max(len(set(c.flatten().tolist())) for c in chosen) >= 6


def test_prefix_cache_preemption_and_chunked_prefill_keep_tokens_identical(reference):
    model_dir, prompts, expected = reference
    llm = LLM(str(model_dir), device="cpu", kvcache_block_size=4, num_kvcache_blocks=40, max_model_len=128,
              max_num_batched_tokens=24)
    preempt_every(llm, 25)
    chunked = watch_chunks(llm)
    assert generate_ids(llm, prompts + prompts[-6:], GREEDY) == expected + expected[-6:]
    assert chunked, "no prompt was split into chunks"
    assert llm.scheduler.num_preemptions > 0
    assert llm.block_manager.num_cache_hits > 0


@pytest.mark.timeout(300)
def test_tp2_splits_every_expert_and_keeps_transformers_tokens(reference):
    model_dir, prompts, expected = reference
    llm = LLM(str(model_dir), device="cpu", tensor_parallel_size=2, kvcache_block_size=4, num_kvcache_blocks=40,
              max_model_len=128, max_num_batched_tokens=32)
    pids = llm.runner.worker_pids
    preempt_every(llm, 25)
    try:
        assert generate_ids(llm, prompts + prompts[-4:], GREEDY) == expected + expected[-4:]
        assert llm.scheduler.num_preemptions > 0
        assert llm.block_manager.num_cache_hits > 0
    finally:
        llm.shutdown()
    assert_ranks_gone(pids)


def test_qwen3_moe_dense_layers_from_mlp_only_layers_and_decoder_sparse_step(tmp_path):
    from engine.layers.mlp import GatedMLP

    model_dir = make_moe_checkpoint("qwen3_moe", tmp_path / "q", num_hidden_layers=4, mlp_only_layers=[2],
                                    decoder_sparse_step=2)
    prompts = prompts_of(6, seed=4)
    llm = LLM(str(model_dir), device="cpu", kvcache_block_size=8)
    kinds = [type(layer.mlp) for layer in llm.runner.model.model.layers]
    assert kinds == [GatedMLP, moe.FusedMoE, GatedMLP, moe.FusedMoE]
    assert generate_ids(llm, prompts, GREEDY) == hf_greedy(model_dir, prompts, MAX_NEW)


def test_mixtral_without_a_sliding_window_attends_to_the_whole_context(tmp_path):
    model_dir = make_moe_checkpoint("mixtral", tmp_path / "m", sliding_window=None)
    prompts = prompts_of(6, seed=6)
    llm = LLM(str(model_dir), device="cpu", kvcache_block_size=8)
    assert [layer.self_attn.attn.window for layer in llm.runner.model.model.layers] == [0, 0]
    assert generate_ids(llm, prompts, GREEDY) == hf_greedy(model_dir, prompts, MAX_NEW)


def test_a_checkpoint_missing_an_experts_tensors_names_the_parameter_and_the_expert(tmp_path):
    from safetensors.torch import load_file, save_file

    model_dir = make_moe_checkpoint("qwen3_moe", tmp_path / "q")
    tensors = load_file(model_dir / "model.safetensors")
    without_layer = {k: v for k, v in tensors.items() if "layers.1.mlp.experts" not in k}
    save_file(without_layer, model_dir / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"lacks weights for: .*model\.layers\.1\.mlp\.experts\.w13"):
        LLM(str(model_dir), device="cpu")
    without_one = {k: v for k, v in tensors.items() if k != "model.layers.0.mlp.experts.5.up_proj.weight"}
    save_file(without_one, model_dir / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"lacks model\.layers\.0\.mlp\.experts\.w13 for: expert 5 up$"):
        LLM(str(model_dir), device="cpu")


def _gpt_oss_experts(seed: int = 0):
    """transformers' gpt-oss experts (fused, interleaved gate/up, biases, clamped SwiGLU) with random weights."""
    import transformers as tf
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    config = tf.GptOssConfig(hidden_size=32, intermediate_size=24, num_local_experts=4, num_experts_per_tok=2,
                             swiglu_limit=1.5)
    torch.manual_seed(seed)
    experts = GptOssExperts(config)
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(0, 0.5)
    return config, experts


@pytest.mark.parametrize("tp_size", [1, 2])
def test_expert_layer_loads_gpt_oss_fused_layout_and_its_clamped_swiglu_matches_transformers(tp_size):
    """Each rank loads its slice of the interleaved [E, H, 2I] gate/up and [E, I, H] down tensors; the ranks'
    parts sum to transformers' GptOssExperts output (a clamp limit small enough to bite)."""
    from engine.layers.parallel import TPGroup

    config, hf = _gpt_oss_experts()
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(40, 32, generator=gen)
    experts = torch.stack([torch.randperm(4, generator=gen)[:2] for _ in range(40)])
    weights = torch.softmax(torch.randn(40, 2, generator=gen), -1)
    with torch.no_grad():
        want = hf(x, experts, weights)
    total = torch.zeros_like(want)
    for rank in range(tp_size):
        layer = moe.FusedMoE(32, 24, 4, 2, TPGroup(rank, tp_size), activation="swiglu_clamped", expert_bias=True,
                             router_bias=True, swiglu_alpha=config.swiglu_alpha, swiglu_limit=config.swiglu_limit)
        e = layer.experts
        e.w13.weight_loader(e.w13, hf.gate_up_proj.data, (None, "gate_up_interleaved_t"))
        e.b13.weight_loader(e.b13, hf.gate_up_proj_bias.data, (None, "gate_up_interleaved_t"))
        e.w2.weight_loader(e.w2, hf.down_proj.data, (None, "down_t"))
        e.b2.weight_loader(e.b2, hf.down_proj_bias.data, (None, "down"))
        total += moe.experts_reference(x, e.w13, e.w2, weights, experts, e.b13, e.b2, "swiglu_clamped",
                                       config.swiglu_alpha, config.swiglu_limit)
    torch.testing.assert_close(total, want, rtol=1e-5, atol=1e-5)
    # the premise: the clamp bites (without it the output differs)
    unclamped = moe.experts_reference(x, e.w13, e.w2, weights, experts, e.b13, e.b2, "swiglu_clamped",
                                      config.swiglu_alpha, 1e9)
    if tp_size == 1:
        assert not torch.allclose(unclamped, want, rtol=1e-3, atol=1e-3)


def test_expert_weights_refuse_a_tensor_of_the_wrong_shape():
    layer = moe.FusedMoE(32, 24, 4, 2)
    w13 = layer.experts.w13
    with pytest.raises(ValueError, match=r"expert tensor of shape \(20, 32\) does not fit experts of intermediate size 24"):
        w13.weight_loader(w13, torch.zeros(20, 32), (1, "gate"))
    with pytest.raises(ValueError, match=r"expert tensor of shape \(24, 30\) does not fit \(24, 32\)"):
        w13.weight_loader(w13, torch.zeros(24, 30), (1, "up"))


def test_routing_renormalises_only_where_asked():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    raw, experts = moe.route(logits, 2, renormalize=False)
    normed, _ = moe.route(logits, 2, renormalize=True)
    assert experts.tolist() == [[0, 1]]
    assert raw.sum().item() < 0.95
    torch.testing.assert_close(normed, torch.softmax(logits[:, :2], -1))


def test_shipped_qwen3_30b_a3b_shape_is_a_qwen3_moe_of_128_experts():
    from engine.config import EngineConfig
    from engine.models import model_class

    config = EngineConfig("qwen3-30b-a3b", load_format="dummy", device="cpu")
    hf = config.hf_config
    assert model_class(hf.architectures).__name__ == "Qwen3MoeForCausalLM"
    assert (hf.num_experts, hf.num_experts_per_tok, hf.moe_intermediate_size, hf.num_hidden_layers) == (128, 8, 768, 48)
    assert model_class(hf.architectures).layer_windows(hf) == [0] * 48


def test_bench_floor_counts_the_experts_a_step_touches():
    """Qwen3-30B-A3B: 30.5B parameters, 3.3B of them read by a one-sequence step (its 8 experts of 128 in each
    layer), nearly all by a step of 256 sequences."""
    from engine.config import EngineConfig
    from worker import bench_engine as bench

    hf = EngineConfig("qwen3-30b-a3b", load_format="dummy", device="cpu").hf_config
    assert round(bench.count_parameters(hf) / 1e9, 1) == 30.5
    assert round(bench.count_parameters(hf, 1) / 1e9, 2) == 3.35
    assert bench.count_parameters(hf, 256) / bench.count_parameters(hf) > 0.99
    params = [SamplingParams(max_tokens=n) for n in (10, 100)]
    one_long = bench.floor_seconds(hf, [[1] * 10] * 2, params, 3e12)
    both_long = bench.floor_seconds(hf, [[1] * 10] * 2, [SamplingParams(max_tokens=100)] * 2, 3e12)
    assert one_long < both_long  # after the short one ends, steps read one sequence's experts
