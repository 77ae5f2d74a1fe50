"""Greedy tokens from LLM.generate equal transformers' generate on the same checkpoint."""
from __future__ import annotations

import random

import pytest

from engine import LLM, SamplingParams
from tests.conftest import hf_greedy, watch_chunks

MAX_NEW = 24


def _prompts(n: int = 20, shared_prefix: int = 0, seed: int = 1) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(3, 500) for _ in range(shared_prefix)]
    return [prefix + [rng.randrange(3, 500) for _ in range(rng.randint(1, 60))] for _ in range(n)]


@pytest.fixture(scope="module")
def reference(checkpoint):
    prompts = _prompts() + _prompts(6, shared_prefix=40, seed=2)
    return checkpoint, prompts, hf_greedy(checkpoint, prompts, MAX_NEW)


def _generate(model_dir, prompts, **engine_kwargs):
    llm = LLM(str(model_dir), device="cpu", **engine_kwargs)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_NEW), use_tqdm=False)
    return llm, [o.token_ids for o in outs]


def test_greedy_tokens_match_transformers(reference):
    model_dir, prompts, expected = reference
    _, got = _generate(model_dir, prompts, kvcache_block_size=8)
    assert got == expected


def test_prefix_cache_hits_keep_tokens_identical(reference):
    model_dir, prompts, expected = reference
    llm, got = _generate(model_dir, prompts + prompts[-6:], kvcache_block_size=8, max_num_seqs=4)
    assert got == expected + expected[-6:]
    assert llm.block_manager.num_cache_hits > 0


def test_preemption_keeps_tokens_identical(reference):
    model_dir, prompts, expected = reference
    llm, got = _generate(model_dir, prompts, kvcache_block_size=4, num_kvcache_blocks=48,
                         max_model_len=128, enable_prefix_caching=False)
    assert llm.scheduler.num_preemptions > 0
    assert got == expected


def test_chunked_prefill_keeps_tokens_identical(reference):
    model_dir, prompts, expected = reference
    llm = LLM(str(model_dir), device="cpu", kvcache_block_size=8, max_num_batched_tokens=16)
    chunked = watch_chunks(llm)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_NEW), use_tqdm=False)
    assert chunked, "no prompt was split into chunks"
    assert [o.token_ids for o in outs] == expected


def test_cache_preemption_and_chunking_together(reference):
    model_dir, prompts, expected = reference
    llm, got = _generate(model_dir, prompts + prompts[-6:], kvcache_block_size=4, num_kvcache_blocks=40,
                         max_model_len=128, max_num_batched_tokens=24)
    assert got == expected + expected[-6:]
    assert llm.scheduler.num_preemptions > 0
    assert llm.block_manager.num_cache_hits > 0
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks


def test_async_scheduling_keeps_tokens_identical(reference):
    """One step in flight (the GPU default), here on CPU: cache, preemption and chunking all on."""
    model_dir, prompts, expected = reference
    llm, got = _generate(model_dir, prompts + prompts[-6:], kvcache_block_size=4, num_kvcache_blocks=40,
                         max_model_len=128, max_num_batched_tokens=24, async_scheduling=True)
    assert llm.async_scheduling
    assert got == expected + expected[-6:]
    assert llm.scheduler.num_preemptions > 0 and llm.block_manager.num_cache_hits > 0
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks


def test_plain_torch_layers_keep_tokens_identical(reference):
    """fused_layers=False (a debugging option) runs the model inside fusion.PlainTorch; the tokens are
    transformers' all the same."""
    from engine.layers import fusion

    model_dir, prompts, expected = reference
    llm = LLM(str(model_dir), device="cpu", kvcache_block_size=8, fused_layers=False)
    modes = []
    decoder = llm.runner.model.model
    forward = decoder.forward

    def recorded(*args):
        modes.append(fusion._PLAIN_TORCH.get())
        return forward(*args)

    decoder.forward = recorded
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_NEW), use_tqdm=False)
    assert [o.token_ids for o in outs] == expected
    assert modes and all(modes)
