"""After a preemption the scheduler keeps free the blocks its running sequences may still need (a share that
decays step by step): a KV cache too small for every admitted sequence's growth preempts far less than when
admission takes every free block, and the tokens are the same."""
from __future__ import annotations

import random

import pytest

import engine.core.scheduler as scheduler
from engine import LLM, SamplingParams
from engine.builtin import TINY_MODEL_DIR
from queue_helpers import one_torch_thread


def _run(monkeypatch, after_preemption: float):
    monkeypatch.setattr(scheduler, "GROWTH_AFTER_PREEMPTION", after_preemption)
    rng = random.Random(0)
    prompts = [[rng.randint(10, 400) for _ in range(rng.randint(20, 60))] for _ in range(48)]
    llm = LLM(TINY_MODEL_DIR, device="cpu", kvcache_block_size=16, num_kvcache_blocks=60, max_num_seqs=64,
              max_model_len=256)
    with one_torch_thread():
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True), use_tqdm=False)
    return llm.scheduler, [o.token_ids for o in outs]


def test_after_a_preemption_admission_keeps_room_for_growth(monkeypatch):
    default = scheduler.GROWTH_AFTER_PREEMPTION
    taking_all, expected = _run(monkeypatch, 0.0)  # admission takes every free block, as before the reserve
    reserving, got = _run(monkeypatch, default)
    assert got == expected
    assert 0 < reserving.num_preemptions <= taking_all.num_preemptions / 2, (reserving.num_preemptions,
                                                                            taking_all.num_preemptions)
    assert reserving.growth_ratio < default  # it decayed once preemptions stopped


@pytest.mark.parametrize("blocks", [7, 8])
def test_a_reserve_never_keeps_the_only_sequence_from_starting(monkeypatch, blocks):
    """With nothing running nothing grows: a waiting sequence that fits starts whatever the ratio."""
    monkeypatch.setattr(scheduler, "GROWTH_DECAY", 1.0)
    llm = LLM(TINY_MODEL_DIR, device="cpu", kvcache_block_size=16, num_kvcache_blocks=blocks, max_num_seqs=4,
              max_model_len=112)
    llm.scheduler.growth_ratio = 1.0
    with one_torch_thread():
        [out] = llm.generate([[11] * 40], SamplingParams(temperature=0, max_tokens=60, ignore_eos=True),
                             use_tqdm=False)
    assert len(out.token_ids) == 60
