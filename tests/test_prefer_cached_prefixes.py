"""The engine's half of cache-aware admission: prefix_block_hashes are the hashes the prefix cache keys blocks
by, and with prefer_cached_prefixes the scheduler admits waiting sequences whose prefix is cached first and
holds back a sibling whose prefix another sequence is computing, with the same greedy tokens."""
from __future__ import annotations

import random

import pytest

from engine import SamplingParams
from engine.core.block_manager import prefix_block_hashes
from queue_helpers import one_torch_thread, tiny_engine

BLOCK = 16
PREFIX = 4 * BLOCK


def _family_prompts(num_prefixes: int, per_prefix: int, seed: int = 0) -> tuple[list[list[int]], list[int]]:
    """Prompts of `num_prefixes` shared prefixes of PREFIX tokens, interleaved (A B C A B C ...), each with a
    suffix of its own; and each prompt's family."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, 400) for _ in range(PREFIX)] for _ in range(num_prefixes)]
    prompts, families = [], []
    for i in range(per_prefix):
        for f, prefix in enumerate(prefixes):
            prompts.append(prefix + [rng.randrange(3, 400) for _ in range(3 + (i * 5 + f) % 11)])
            families.append(f)
    return prompts, families


def _computed_prompt_tokens(engine) -> int:
    bm = engine.block_manager
    return bm.num_cache_queries - bm.num_cache_hits


def test_prefix_block_hashes_are_the_hashes_the_prefix_cache_enters():
    with one_torch_thread():
        engine = tiny_engine(kvcache_block_size=BLOCK, num_kvcache_blocks=32, max_model_len=256)
        prompt = list(range(5, 5 + 3 * BLOCK + 7))
        engine.generate([prompt], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    hashes = prefix_block_hashes(prompt, BLOCK)
    assert len(hashes) == 3  # the partial last block is never looked up
    assert all(h in engine.block_manager.hash_to_block_id for h in hashes)
    assert engine.num_cached_blocks(hashes) == 3
    assert engine.num_cached_blocks(prefix_block_hashes([9] + prompt[1:], BLOCK)) == 0
    # a prompt of exactly whole blocks: its last block holds the token always computed, so it is not looked up
    assert len(prefix_block_hashes(list(range(2 * BLOCK)), BLOCK)) == 1


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_preferring_cached_prefixes_computes_each_shared_prefix_once_with_the_same_tokens(async_scheduling):
    prompts, _ = _family_prompts(num_prefixes=3, per_prefix=4)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    runs = {}
    with one_torch_thread():
        for prefer in (False, True):
            # async: a prefix's blocks enter the cache a step after they are computed, when that step is collected
            engine = tiny_engine(kvcache_block_size=BLOCK, num_kvcache_blocks=64, max_num_seqs=6, max_model_len=256,
                                 prefer_cached_prefixes=prefer, async_scheduling=async_scheduling)
            outs = engine.generate(prompts, params, use_tqdm=False)
            runs[prefer] = ([o.token_ids for o in outs], _computed_prompt_tokens(engine))
    ideal = sum(len(p) - PREFIX for p in prompts) + 3 * PREFIX
    assert runs[True][0] == runs[False][0]
    assert runs[True][1] == ideal
    # arrival order admits siblings in the same step, each computing the prefix the other is computing
    assert runs[False][1] >= ideal + 3 * PREFIX


@pytest.mark.gpu
def test_on_the_gpu_preferring_cached_prefixes_computes_each_prefix_once_with_the_same_tokens(qwen3_checkpoint,
                                                                                              free_gpu):
    """The GPU's default step (async scheduling, CUDA graphs, 256-token blocks) with three interleaved prefixes of
    two blocks each: the ideal prompt work with prefer_cached_prefixes, every prefix again without."""
    from engine import LLM

    block = 256
    rng = random.Random(1)
    prefixes = [[rng.randrange(3, 500) for _ in range(2 * block)] for _ in range(3)]
    prompts = [prefix + [rng.randrange(3, 500) for _ in range(5 + (i * 7 + f) % 40)]
               for i in range(4) for f, prefix in enumerate(prefixes)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    runs = {}
    for prefer in (False, True):
        llm = LLM(str(qwen3_checkpoint), device="cuda", dtype="float32", max_model_len=1024, max_num_seqs=6,
                  max_num_batched_tokens=8192,
                  kvcache_block_size=block, num_kvcache_blocks=32, prefer_cached_prefixes=prefer)
        outs = llm.generate(prompts, params, use_tqdm=False)
        runs[prefer] = ([o.token_ids for o in outs], _computed_prompt_tokens(llm))
        llm.shutdown()
    ideal = sum(len(p) - 2 * block for p in prompts) + 3 * 2 * block
    assert runs[True][1] == ideal
    assert runs[False][1] >= ideal + 3 * 2 * block
    assert runs[True][0] == runs[False][0]
