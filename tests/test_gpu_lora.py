"""LoRA adapters on a GPU: the Triton shrink/expand kernels in a mixed batch (adapters and the base, more
adapters than slots), eager prefills and decode steps replaying the LoRA CUDA graphs, give transformers'
merged-adapter greedy tokens; the base model's steps keep theirs."""
from __future__ import annotations

import pytest

from engine import LLM
from tests.test_lora import GREEDY, _expected, _mixed, setup  # noqa: F401 - setup: the module's fixture

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("max_loras", [4, 2])
def test_mixed_batch_on_gpu_kernels_matches_transformers(setup, max_loras, free_gpu):  # noqa: F811
    base, prompts, requests, expected = setup
    llm = LLM(str(base), device="cuda", dtype="float32", enable_lora=True, max_loras=max_loras, max_lora_rank=16,
              kvcache_block_size=16, max_model_len=256, max_num_seqs=16)
    try:
        calls = []
        from engine.kernels import lora as kernels

        original = kernels.lora_add
        graphs, lora_replays = llm.runner.graphs, []
        choose = graphs._graph
        graphs._graph = lambda inputs, bs: (lora_replays.append(inputs.lora_slot_ids is not None), choose(inputs, bs))[1]
        kernels.lora_add = lambda *a, **k: (calls.append(1), original(*a, **k))[1]
        try:
            all_prompts, loras = _mixed(prompts, requests)
            outs = llm.generate(all_prompts, GREEDY, use_tqdm=False, lora_request=loras)
        finally:
            kernels.lora_add = original
        assert calls, "the LoRA kernels did not run"
        assert llm.runner.graphs.lora_graphs and any(lora_replays), "no decode step replayed a LoRA graph"
        assert [o.token_ids for o in outs] == _expected(prompts, requests, expected, zip(all_prompts, loras))
        base_only = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert [o.token_ids for o in base_only] == expected[None]
    finally:
        llm.shutdown()


def test_shutdown_hands_the_lora_slots_back(setup, free_gpu):  # noqa: F811
    import torch

    base = setup[0]
    before = torch.cuda.memory_allocated()
    llm = LLM(str(base), device="cuda", enable_lora=True, max_loras=8, max_lora_rank=64, gpu_memory_utilization=0.2)
    llm.shutdown()
    assert torch.cuda.memory_allocated() <= before + (1 << 20)
