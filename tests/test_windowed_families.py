"""Mistral, Gemma 2, Gemma 3 and Phi-3 against transformers on the same checkpoints: sliding windows shorter
than the prompts, Gemma's soft-capped logits, (1 + weight) norms, scaled embeddings and local rope, Phi-3's
packed checkpoint and LongRoPE. Greedy tokens equal transformers' generate, also through prefix-cache hits,
forced preemption, chunked prefill and TP=2; quantized tensors in a checkpoint without a quantization_config
are named in one line (quantized checkpoints: tests/test_quant_fp8.py)."""
from __future__ import annotations

import importlib.util
import json
import random
import shutil
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from tests.conftest import WINDOWED_FAMILIES, hf_greedy, make_checkpoint, preempt_every, watch_chunks
from tests.interpreter import run_under_interpreter
from tests.test_tp import assert_ranks_gone, generate_ids

MAX_NEW = 24
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW)


def prompts_of(n: int, shared_prefix: int = 0, seed: int = 1, longest: int = 60) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(3, 500) for _ in range(shared_prefix)]
    return [prefix + [rng.randrange(3, 500) for _ in range(rng.randint(1, longest))] for _ in range(n)]


@pytest.fixture(scope="module", params=WINDOWED_FAMILIES)
def reference(request, tmp_path_factory):
    """A checkpoint of the family, prompts (most longer than its windows; six sharing a 40-token prefix) and
    transformers' greedy completions."""
    model_dir = make_checkpoint(request.param, tmp_path_factory.mktemp(request.param))
    prompts = prompts_of(14) + prompts_of(6, shared_prefix=40, seed=2)
    return model_dir, prompts, hf_greedy(model_dir, prompts, MAX_NEW)


def test_greedy_tokens_match_transformers(reference):
    model_dir, prompts, expected = reference
    llm = LLM(str(model_dir), device="cpu", kvcache_block_size=8)
    assert generate_ids(llm, prompts, GREEDY) == expected


def test_prefix_cache_preemption_and_chunked_prefill_keep_tokens_identical(reference):
    """Cached prefixes (blocks computed for another sequence, some older than the window), sequences
    preempted and recomputed, prompts split into chunks that start inside a window: transformers' tokens.
    (Where every layer slides, preempt_every forces the preemptions.)"""
    model_dir, prompts, expected = reference
    llm = LLM(str(model_dir), device="cpu", kvcache_block_size=4, num_kvcache_blocks=40, max_model_len=128,
              max_num_batched_tokens=24)
    preempt_every(llm, 25, sliding_only=True)
    chunked = watch_chunks(llm)
    assert generate_ids(llm, prompts + prompts[-6:], GREEDY) == expected + expected[-6:]
    assert chunked, "no prompt was split into chunks"
    assert llm.scheduler.num_preemptions > 0
    assert llm.block_manager.num_cache_hits > 0
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks


@pytest.mark.timeout(300)
def test_tp2_tokens_match_transformers_with_prefix_cache_and_preemption(reference):
    model_dir, prompts, expected = reference
    llm = LLM(str(model_dir), device="cpu", tensor_parallel_size=2, kvcache_block_size=4, num_kvcache_blocks=40,
              max_model_len=128, max_num_batched_tokens=32)
    preempt_every(llm, 25, sliding_only=True)
    pids = llm.runner.worker_pids
    try:
        assert generate_ids(llm, prompts + prompts[-4:], GREEDY) == expected + expected[-4:]
        assert llm.scheduler.num_preemptions > 0
        assert llm.block_manager.num_cache_hits > 0
    finally:
        llm.shutdown()
    assert_ranks_gone(pids)


def test_gemma2_final_soft_cap_reaches_the_sampler(tmp_path):
    """The capped logits are what the sampler sees: each token's logprob equals transformers' log_softmax of
    its capped logits (greedy tokens alone would not tell, capping keeps the argmax)."""
    from transformers import AutoModelForCausalLM

    model_dir = make_checkpoint("gemma2", tmp_path / "gemma2", final_logit_softcapping=1.5)
    prompts = prompts_of(3, seed=5)
    llm = LLM(str(model_dir), device="cpu", kvcache_block_size=8)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, logprobs=1), use_tqdm=False)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    for prompt, out in zip(prompts, outs):
        ids = torch.tensor([prompt + out.token_ids[:-1]])
        with torch.no_grad():
            logits = model(ids).logits[0, len(prompt) - 1:]
        assert logits.abs().max() <= 1.5  # the cap is in transformers' logits too
        want = logits.log_softmax(-1).gather(1, torch.tensor(out.token_ids)[:, None]).squeeze(1)
        assert [lp["logprob"] for lp in out.logprobs] == pytest.approx(want.tolist(), abs=1e-4)


def test_phi3_longrope_takes_the_long_factors_past_the_original_length_as_transformers_does(tmp_path):
    """Sequences that stay within original_max_position_embeddings rotate with the short factors, prompts longer
    than it with the long ones throughout."""
    model_dir = make_checkpoint("phi3", tmp_path / "phi3", original_max_position_embeddings=40,
                                max_position_embeddings=1024)
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randint(1, 40 - MAX_NEW + 1))] for _ in range(5)]
    prompts += [[rng.randrange(3, 500) for _ in range(rng.randint(41, 90))] for _ in range(5)]
    expected = hf_greedy(model_dir, prompts, MAX_NEW)
    llm = LLM(str(model_dir), device="cpu", kvcache_block_size=8)
    assert llm.block_manager.long_rope_after == 40
    assert generate_ids(llm, prompts, GREEDY) == expected
    # the premise: the long factors change these completions (the same model with long = short factors)
    config = json.loads((model_dir / "config.json").read_text())
    config["rope_parameters"]["long_factor"] = config["rope_parameters"]["short_factor"]
    (model_dir / "config.json").write_text(json.dumps(config))
    assert generate_ids(LLM(str(model_dir), device="cpu", kvcache_block_size=8), prompts, GREEDY) != expected


@pytest.mark.parametrize("engine_kwargs", [
    dict(kvcache_block_size=8),
    dict(kvcache_block_size=4, num_kvcache_blocks=40, max_num_batched_tokens=16, max_model_len=128),
], ids=["whole-prompts", "chunked-preempted"])
def test_phi3_longrope_sequences_that_cross_the_original_length_match_transformers(tmp_path, engine_kwargs):
    """A sequence that generates past original_max_position_embeddings is computed anew with the long factors
    at that token, as transformers recomputes its cache there; a long prompt prefilled in chunks rotates with
    the long factors from its first chunk; blocks of short-factor sequences never serve a prefix of long-factor
    ones (the long prompts share the short ones' first 24 tokens)."""
    model_dir = make_checkpoint("phi3", tmp_path / "phi3", original_max_position_embeddings=40,
                                max_position_embeddings=1024)
    rng = random.Random(11)
    shared = [rng.randrange(3, 500) for _ in range(24)]
    crossing = [shared + [rng.randrange(3, 500) for _ in range(rng.randint(2, 14))] for _ in range(5)]
    long = [shared + [rng.randrange(3, 500) for _ in range(rng.randint(20, 60))] for _ in range(3)]
    prompts = crossing + long + crossing[:2]
    expected = hf_greedy(model_dir, prompts, MAX_NEW)
    llm = LLM(str(model_dir), device="cpu", **engine_kwargs)
    if "num_kvcache_blocks" in engine_kwargs:
        preempt_every(llm, 20, sliding_only=True)
    released, release = [], llm.scheduler._release
    llm.scheduler._release = lambda seq, to_back=False: (released.append(seq.seq_id), release(seq, to_back))[1]
    assert generate_ids(llm, prompts, GREEDY) == expected
    assert len(released) - llm.scheduler.num_preemptions >= len(crossing)  # each crossing one computed anew
    assert llm.block_manager.num_cache_hits > 0
    if "num_kvcache_blocks" in engine_kwargs:
        assert llm.scheduler.num_preemptions > 0


@pytest.mark.parametrize("engine_kwargs", [
    dict(kvcache_block_size=4),
    dict(kvcache_block_size=4, num_kvcache_blocks=64, max_num_batched_tokens=16),
], ids=["roomy", "chunked-preempted"])
def test_mistral_long_generation_hands_back_blocks_outside_the_window_and_matches_transformers(tmp_path,
                                                                                              engine_kwargs):
    """Every layer slides (window 10): a sequence of up to 190 tokens holds about window / block size blocks
    (the window's, the next token's, one waiting for the prefix cache), not one per 4 tokens; finished prompts
    find their handed-back blocks cached; n = 2 completions that share a prompt's blocks hand them back apart;
    tokens equal transformers', through chunked prefill and preemption too (forced, of sequences that handed
    blocks back)."""
    model_dir = make_checkpoint("mistral", tmp_path / "mistral")
    prompts = prompts_of(4, seed=21, longest=40) + prompts_of(2, shared_prefix=30, seed=22, longest=20)
    max_new = 150
    expected = hf_greedy(model_dir, prompts, max_new)
    llm = LLM(str(model_dir), device="cpu", max_model_len=256, **engine_kwargs)
    assert llm.block_manager.sliding_window == 10
    if "num_kvcache_blocks" in engine_kwargs:
        preempt_every(llm, 40, sliding_only=True)
    held, schedule = [], llm.scheduler.schedule

    def spy():
        batch = schedule()
        # (a prompt's blocks are handed back from its third token on, once they are in the prefix cache)
        held.extend(len(s.block_table) - s.num_released_blocks for s in llm.scheduler.running
                    if s.num_completion_tokens > 2)
        return batch

    llm.scheduler.schedule = spy
    assert generate_ids(llm, prompts, SamplingParams(temperature=0, max_tokens=max_new)) == expected
    if "num_kvcache_blocks" in engine_kwargs:  # (a preempted sequence takes blocks for all its tokens again)
        assert llm.scheduler.num_preemptions >= 2
    else:
        assert max(held) <= 10 // 4 + 3, max(held)
        # the handed-back blocks of finished sequences serve their prompts again, from the first block
        again = generate_ids(llm, prompts[-2:], SamplingParams(temperature=0, max_tokens=max_new))
        assert again == expected[-2:] and llm.block_manager.num_cache_hits > 0
        pairs = llm.generate(prompts[:2], SamplingParams(n=2, temperature=0, max_tokens=max_new), use_tqdm=False)
        assert [[c.token_ids for c in o.outputs] for o in pairs] == [[e, e] for e in expected[:2]]
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks  # every block handed back once


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_handed_back_blocks_on_the_gpu_kernels_under_the_interpreter_keep_transformers_tokens():
    """Mistral on the triton backend (prefill, split-KV and fused decode), run by the Triton interpreter: pages of
    4 positions handed back behind a window of 10 lie under the kernels' tiles of 16, read there, never weighed."""
    results = run_under_interpreter(Path(__file__).parent / "engine_on_kernels_cases.py",
                                    "mistral_handed_back")["mistral_handed_back"]
    assert results["equal"], results
    assert results["most_released"] > 5 and results["fused_decode_calls"] > 0 and results["prefill_calls"] > 0


def test_mistral_beams_fork_from_sequences_that_handed_blocks_back_and_keep_transformers_beams(tmp_path):
    from engine import BeamSearchParams
    from tests.breadth_helpers import hf_beams, load_hf

    model_dir = make_checkpoint("mistral", tmp_path / "mistral")
    prompts = prompts_of(3, seed=31, longest=30)
    llm = LLM(str(model_dir), device="cpu", kvcache_block_size=4)
    released, schedule = [], llm.scheduler.schedule

    def spy():
        batch = schedule()
        released.extend(s.num_released_blocks for s in llm.scheduler.running)
        return batch

    llm.scheduler.schedule = spy
    outs = llm.beam_search(prompts, BeamSearchParams(beam_width=3, max_tokens=50, ignore_eos=True))
    hf = load_hf(model_dir)
    for prompt, out in zip(prompts, outs):
        assert [c.token_ids for c in out.outputs] == [t for t, _ in hf_beams(hf, prompt, 3, 50, 1.0, eos=10 ** 6)]
    assert max(released) > 5
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks


def test_blocks_are_held_whole_where_some_layer_sees_the_whole_context(tmp_path):
    model_dir = make_checkpoint("gemma2", tmp_path / "gemma2")
    llm = LLM(str(model_dir), device="cpu", kvcache_block_size=4)
    assert llm.block_manager.sliding_window == 0
    prompts = prompts_of(2, seed=23)
    held, schedule = [], llm.scheduler.schedule

    def spy():
        batch = schedule()
        held.extend(s.num_released_blocks for s in llm.scheduler.running)
        return batch

    llm.scheduler.schedule = spy
    generate_ids(llm, prompts, SamplingParams(temperature=0, max_tokens=40))
    assert max(held) == 0


def test_qwen2_with_use_sliding_window_windows_the_layers_past_max_window_layers(tmp_path):
    model_dir = make_checkpoint("qwen2", tmp_path / "qwen2", use_sliding_window=True, sliding_window=8,
                                max_window_layers=1)
    prompts = prompts_of(8, seed=9)
    expected = hf_greedy(model_dir, prompts, MAX_NEW)
    llm = LLM(str(model_dir), device="cpu", kvcache_block_size=8)
    assert [layer.self_attn.attn.window for layer in llm.runner.model.model.layers] == [0, 8]
    assert generate_ids(llm, prompts, GREEDY) == expected


def test_quantized_tensors_without_a_quantization_config_are_named_as_such(qwen3_checkpoint, tmp_path):
    from safetensors.torch import load_file, save_file

    model_dir = tmp_path / "scales"
    shutil.copytree(qwen3_checkpoint, model_dir)
    tensors = load_file(model_dir / "model.safetensors")
    tensors["model.layers.0.mlp.down_proj.weight_scale_inv"] = torch.ones(1, 1)
    save_file(tensors, model_dir / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"^checkpoint tensor 'model\.layers\.0\.mlp\.down_proj\.weight_scale_inv' "
                                         r"is a quantized layer's[^\n]*no quantization_config[^\n]*$"):
        LLM(str(model_dir), device="cpu")


def test_shipped_gemma3_and_phi3_shapes_resolve_to_their_families():
    from engine.config import EngineConfig
    from engine.models import model_class

    gemma = EngineConfig("gemma3-1b", load_format="dummy", device="cpu")
    windows = model_class(gemma.hf_config.architectures).layer_windows(gemma.hf_config)
    assert windows == [512] * 5 + [0] + [512] * 5 + [0] + [512] * 5 + [0] + [512] * 5 + [0] + [512, 512]
    phi3 = EngineConfig("phi3-mini", load_format="dummy", device="cpu")
    assert model_class(phi3.hf_config.architectures).layer_windows(phi3.hf_config) == [2047] * 32


def test_unsupported_rope_variants_are_refused_with_the_reason():
    from types import SimpleNamespace

    from engine.layers.rotary import rope_settings

    partial = SimpleNamespace(rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                               "partial_rotary_factor": 0.75})
    with pytest.raises(ValueError, match=r"partial rotary embeddings \(partial_rotary_factor=0.75\) are not supported"):
        rope_settings(partial)
    with pytest.raises(ValueError, match="rope scaling type 'dynamic' is not supported"):
        rope_settings(SimpleNamespace(rope_parameters={"rope_type": "dynamic", "factor": 2.0}))
