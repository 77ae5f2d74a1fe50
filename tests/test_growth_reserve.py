"""After a preemption the scheduler keeps free the blocks its running sequences are expected still to take (a
share that decays step by step): a KV cache too small for every admitted sequence's growth preempts far less
than when admission takes every free block, the tokens are the same, and sequences that stop early are not
held back for the max_tokens they will not use."""
from __future__ import annotations

import random

import pytest

import engine.core.scheduler as scheduler
from engine import LLM, SamplingParams
from engine.builtin import TINY_MODEL_DIR
from queue_helpers import one_torch_thread


def _run(monkeypatch, reserve: bool, prompts, params, **engine):
    if not reserve:  # the ratio set at a preemption is gone by the next step: admission takes every free block
        monkeypatch.setattr(scheduler, "GROWTH_DECAY", 0.0)
    llm = LLM(TINY_MODEL_DIR, device="cpu", kvcache_block_size=16, **engine)
    steps, schedule = [0], llm.scheduler.schedule

    def counted():
        steps[0] += 1
        return schedule()
    llm.scheduler.schedule = counted
    with one_torch_thread():
        outs = llm.generate(prompts, params, use_tqdm=False)
    monkeypatch.undo()
    return llm.scheduler, steps[0], [o.token_ids for o in outs]


def _prompts(n: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randint(10, 400) for _ in range(rng.randint(20, 60))] for _ in range(n)]


def test_after_a_preemption_admission_keeps_room_for_growth(monkeypatch):
    prompts, params = _prompts(48), SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    engine = dict(num_kvcache_blocks=60, max_num_seqs=64, max_model_len=256)
    taking_all, _, expected = _run(monkeypatch, False, prompts, params, **engine)
    reserving, _, got = _run(monkeypatch, True, prompts, params, **engine)
    assert got == expected
    assert 0 < reserving.num_preemptions <= taking_all.num_preemptions / 2, (reserving.num_preemptions,
                                                                            taking_all.num_preemptions)
    assert reserving.growth_ratio < 1.0  # it decayed once preemptions stopped


def test_sequences_that_stop_early_are_expected_to_stop_early(monkeypatch):
    """Stop tokens end the completions after ~35 of their 400 max_tokens: the reserve counts what finished
    sequences used, so it still cuts the preemptions without running many more (smaller) steps."""
    prompts = _prompts(200)
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=400, stop_token_ids=list(range(100, 115)))
              for i in range(len(prompts))]
    engine = dict(num_kvcache_blocks=120, max_num_seqs=128, max_model_len=512)
    taking_all, steps_all, expected = _run(monkeypatch, False, prompts, params, **engine)
    reserving, steps, got = _run(monkeypatch, True, prompts, params, **engine)
    assert got == expected
    assert reserving.used_share < 0.2
    assert reserving.num_preemptions <= taking_all.num_preemptions / 4, (reserving.num_preemptions,
                                                                        taking_all.num_preemptions)
    assert steps <= 1.2 * steps_all, (steps, steps_all)


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


def test_only_completions_that_ended_by_their_own_tokens_teach_the_share():
    """Embeddings (no completion tokens) and aborted requests say nothing of how long completions run."""
    llm = LLM(TINY_MODEL_DIR, device="cpu", kvcache_block_size=16, max_model_len=256)
    with one_torch_thread():
        llm.embed([[11] * 20] * 8)
        llm.add_request([12] * 20, SamplingParams(temperature=0, max_tokens=100, ignore_eos=True), request_id="gone")
        llm.step()
        llm.abort("gone")
        while llm.has_unfinished():
            llm.step()
        assert llm.scheduler.used_share == scheduler.USED_SHARE_PRIOR
        llm.generate([[13] * 20], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    assert llm.scheduler.used_share > scheduler.USED_SHARE_PRIOR  # one that ran to its max_tokens moves it up
