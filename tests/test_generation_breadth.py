"""n > 1 and best_of over shared KV blocks, penalties, logit bias, min_tokens, max_tokens=None, cumulative
logprobs and chat, on tiny checkpoints written by transformers (CPU, fp32)."""
from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.builtin import TINY_MODEL_DIR
from tests.breadth_helpers import checkpoint_with_eos, hf_adjusted_greedy, load_hf

PROMPTS = [[5, 17, 300, 42, 9, 9, 1], [7] * 11, [100, 200, 300, 400, 5, 6, 7, 8, 9], [3]]
MAX_NEW = 16


@pytest.fixture(scope="module")
def hf(qwen3_checkpoint):
    return load_hf(qwen3_checkpoint)


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def llm(qwen3_checkpoint, request):
    return LLM(str(qwen3_checkpoint), device="cpu", kvcache_block_size=4, async_scheduling=request.param)


def greedy(**kwargs) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, **kwargs)


def assert_no_leaks(llm) -> None:
    bm = llm.block_manager
    assert bm.num_free_blocks == bm.num_blocks and all(b.ref_count == 0 for b in bm.blocks)
    llm.generate([[1]], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)  # the runner frees with the next step
    sampler = llm.runner.sampler
    assert not sampler.token_counts.slot_of and not sampler.generators  # every sequence gave its state back


# ---- penalties and biases ----------------------------------------------------------------------------

@pytest.mark.parametrize("penalty", [1.3, 0.7, 2.0])
def test_greedy_with_repetition_penalty_equals_transformers(qwen3_checkpoint, hf, llm, penalty):
    outs = llm.generate(PROMPTS, greedy(repetition_penalty=penalty), use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        ids = torch.tensor([prompt])
        want = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=MAX_NEW,
                           repetition_penalty=penalty, eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        assert out.token_ids == want
    plain = llm.generate(PROMPTS, greedy(), use_tqdm=False)
    assert [o.token_ids for o in outs] != [o.token_ids for o in plain]  # the penalty changed something
    assert_no_leaks(llm)


_REFERENCES: dict = {}


def reference(hf, prompt: list[int], presence: float = 0.0, frequency: float = 0.0, bias: dict | None = None):
    """(greedy tokens, their summed logprob) from transformers' logits with the OpenAI adjustments, once."""
    key = (tuple(prompt), presence, frequency, tuple(sorted((bias or {}).items())))
    if key not in _REFERENCES:
        _REFERENCES[key] = hf_adjusted_greedy(hf, prompt, MAX_NEW, openai_adjust(presence, frequency, bias or {}))
    return _REFERENCES[key]


def openai_adjust(presence: float, frequency: float, bias: dict[int, float]):
    def adjust(logits: torch.Tensor, generated: list[int]) -> torch.Tensor:
        counts = torch.bincount(torch.tensor(generated, dtype=torch.int64), minlength=logits.shape[0]).float()
        logits = logits - frequency * counts - presence * (counts > 0).float()
        for token, b in bias.items():
            logits[token] += b
        return logits
    return adjust


@pytest.mark.parametrize("presence, frequency, bias", [
    (1.5, 0.0, {}), (0.0, 0.6, {}), (-0.5, 1.2, {}), (0.0, 0.0, {13: 3.5, 40: -2.0, 200: 7.0}),
    (0.8, 0.4, {13: 5.0, 7: -100.0}),
])
def test_presence_frequency_and_bias_equal_a_reference_from_the_logits(hf, llm, presence, frequency, bias):
    params = greedy(presence_penalty=presence, frequency_penalty=frequency, logit_bias=bias)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    changed = False
    for prompt, out in zip(PROMPTS, outs):
        want, logprob = reference(hf, prompt, presence, frequency, bias)
        assert out.token_ids == want
        assert out.cumulative_logprob == pytest.approx(logprob, abs=1e-3)  # of the adjusted distribution
        changed |= want != reference(hf, prompt)[0]
    assert changed
    assert_no_leaks(llm)


def test_a_large_positive_bias_forces_its_token_and_a_large_negative_one_bans_it(llm):
    forced = llm.generate(PROMPTS, SamplingParams(temperature=1.0, max_tokens=8, logit_bias={"77": 100}),
                          use_tqdm=False)
    assert all(o.token_ids == [77] * 8 for o in forced)
    plain = llm.generate(PROMPTS, greedy(), use_tqdm=False)
    banned = {o.token_ids[0] for o in plain}
    outs = llm.generate(PROMPTS, greedy(logit_bias={t: -100 for t in banned}), use_tqdm=False)
    assert not banned & {t for o in outs for t in o.token_ids}


def test_penalised_and_plain_requests_share_a_batch_without_changing_each_other(llm):
    plain = llm.generate(PROMPTS, greedy(), use_tqdm=False)
    mixed = [greedy(), greedy(frequency_penalty=1.0), greedy(), greedy(repetition_penalty=1.5)]
    outs = llm.generate(PROMPTS, mixed, use_tqdm=False)
    assert outs[0].token_ids == plain[0].token_ids and outs[2].token_ids == plain[2].token_ids
    assert outs[1].token_ids != plain[1].token_ids
    assert_no_leaks(llm)


def test_logit_bias_outside_the_vocabulary_is_refused_naming_it(llm):
    with pytest.raises(ValueError, match="logit_bias token id 512 is outside the vocabulary"):
        llm.generate(PROMPTS, greedy(logit_bias={512: 1.0}), use_tqdm=False)
    assert not llm.has_unfinished()


# ---- min_tokens, max_tokens=None ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def near_eos(qwen3_checkpoint, tmp_path_factory):
    """An engine on the checkpoint with its EOS made the third token greedy decoding takes for PROMPTS[0],
    and a token greedy decoding takes a little later (a stop id)."""
    base = LLM(str(qwen3_checkpoint), device="cpu", kvcache_block_size=4)
    ids = base.generate([PROMPTS[0]], greedy(), use_tqdm=False)[0].token_ids
    eos = ids[2]
    stop = next(t for t in ids[ids.index(eos) + 1:] if t != eos)
    path = checkpoint_with_eos(qwen3_checkpoint, eos, tmp_path_factory.mktemp("near-eos"))
    return LLM(str(path), device="cpu", kvcache_block_size=4), eos, stop


def test_min_tokens_never_ends_early(near_eos):
    llm, eos, stop = near_eos
    params = dict(temperature=0, max_tokens=MAX_NEW, stop_token_ids=[stop])
    early = llm.generate([PROMPTS[0]], SamplingParams(**params), use_tqdm=False)[0]
    assert early.finish_reason == "stop" and len(early.token_ids) < 8
    for min_tokens in (8, MAX_NEW):
        out = llm.generate([PROMPTS[0]], SamplingParams(min_tokens=min_tokens, **params), use_tqdm=False)[0]
        assert len(out.token_ids) >= min_tokens
        assert not {eos, stop} & set(out.token_ids[:min_tokens])
        sampled = llm.generate([PROMPTS[0]] * 4, SamplingParams(**{**params, "temperature": 1.5},
                                                                 min_tokens=min_tokens), use_tqdm=False)
        assert all(len(o.token_ids) >= min_tokens for o in sampled)
    assert_no_leaks(llm)


def test_max_tokens_none_generates_until_max_model_len(qwen3_checkpoint):
    llm = LLM(str(qwen3_checkpoint), device="cpu", kvcache_block_size=4, max_model_len=40)
    out = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=None, ignore_eos=True),
                       use_tqdm=False)[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 40 - len(PROMPTS[0])


# ---- n, best_of, cumulative logprobs ------------------------------------------------------------------

def test_n_with_a_seed_is_reproducible_and_its_completions_differ(llm):
    params = SamplingParams(n=4, temperature=1.0, seed=11, max_tokens=MAX_NEW)
    first = llm.generate(PROMPTS, params, use_tqdm=False)
    again = llm.generate(PROMPTS, params, use_tqdm=False)
    for a, b in zip(first, again):
        assert [c.index for c in a.outputs] == [0, 1, 2, 3]
        assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
        assert len({tuple(c.token_ids) for c in a.outputs}) == 4
        assert a.token_ids == a.outputs[0].token_ids and a.text == a.outputs[0].text
    one = llm.generate(PROMPTS, SamplingParams(temperature=1.0, seed=11, max_tokens=MAX_NEW), use_tqdm=False)
    assert [o.token_ids for o in one] == [o.outputs[0].token_ids for o in first]
    assert_no_leaks(llm)


def test_best_of_returns_the_n_best_by_cumulative_logprob(llm):
    four = llm.generate(PROMPTS, SamplingParams(n=4, temperature=1.0, seed=5, max_tokens=10), use_tqdm=False)
    best = llm.generate(PROMPTS, SamplingParams(n=2, best_of=4, temperature=1.0, seed=5, max_tokens=10),
                        use_tqdm=False)
    for all4, two in zip(four, best):
        ranked = sorted(all4.outputs, key=lambda c: -c.cumulative_logprob)[:2]
        assert [c.token_ids for c in two.outputs] == [c.token_ids for c in ranked]
        assert [c.index for c in two.outputs] == [0, 1]
        assert two.outputs[0].cumulative_logprob >= two.outputs[1].cumulative_logprob


def test_cumulative_logprob_is_the_sum_of_the_token_logprobs(hf, llm):
    outs = llm.generate(PROMPTS, SamplingParams(n=2, temperature=0.9, seed=3, max_tokens=MAX_NEW, logprobs=2),
                        use_tqdm=False)
    for out in outs:
        for c in out.outputs:
            assert len(c.logprobs) == len(c.token_ids)
            assert c.cumulative_logprob == pytest.approx(sum(e["logprob"] for e in c.logprobs), abs=1e-4)
    plain = llm.generate([PROMPTS[0]], greedy(), use_tqdm=False)[0]
    assert plain.cumulative_logprob == pytest.approx(reference(hf, PROMPTS[0])[1], abs=1e-3)


@pytest.mark.parametrize("engine_kwargs", [
    dict(kvcache_block_size=4),
    dict(kvcache_block_size=4, num_kvcache_blocks=24, max_model_len=64, max_num_batched_tokens=16),
    dict(kvcache_block_size=4, num_kvcache_blocks=24, max_model_len=64, enable_prefix_caching=False,
         async_scheduling=True),
], ids=["roomy", "preempting-chunked", "preempting-no-cache-async"])
def test_greedy_forks_share_the_prompt_and_equal_one_sequence(qwen3_checkpoint, engine_kwargs):
    """n greedy completions are the one greedy completion: the forks read the prompt's K/V through shared
    blocks and the copy of its partly filled last block, through preemption and recomputation."""
    llm = LLM(str(qwen3_checkpoint), device="cpu", **engine_kwargs)
    want = [o.token_ids for o in llm.generate(PROMPTS, greedy(), use_tqdm=False)]
    queries = llm.block_manager.num_cache_queries
    outs = llm.generate(PROMPTS, greedy(n=3), use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in outs] == [[w] * 3 for w in want]
    if "num_kvcache_blocks" in engine_kwargs:
        assert llm.scheduler.num_preemptions > 0
    else:  # each prompt was prefilled once, not once per completion
        assert llm.block_manager.num_cache_queries - queries == sum(len(p) for p in PROMPTS)
    assert_no_leaks(llm)


def test_shared_blocks_are_freed_once_after_finish_abort_and_preemption(qwen3_checkpoint):
    llm = LLM(str(qwen3_checkpoint), device="cpu", kvcache_block_size=4, num_kvcache_blocks=24, max_model_len=64,
              async_scheduling=True)
    ids = [llm.add_request(p, SamplingParams(n=3, temperature=1.0, max_tokens=20, frequency_penalty=0.5))
           for p in PROMPTS]
    for _ in range(4):
        llm.step()
    assert llm.abort(ids[1]) and llm.abort(ids[3])
    finished = {}
    while llm.has_unfinished():
        for out in llm.step().finished:
            finished[out.request_id] = out
    assert sorted(finished) == sorted(ids) and llm.scheduler.num_preemptions > 0
    assert [c.finish_reason for c in finished[ids[1]].outputs] == ["abort"] * 3
    assert all(c.finish_reason in ("stop", "length") for c in finished[ids[0]].outputs)
    assert_no_leaks(llm)


def test_n_larger_than_the_engine_takes_is_refused_in_one_line():
    llm = LLM(TINY_MODEL_DIR, load_format="dummy", device="cpu", max_num_seqs=2)
    with pytest.raises(ValueError, match="best_of=3 needs 3 sequences at once; max_num_seqs is 2"):
        llm.generate([[1, 2]], SamplingParams(n=1, best_of=3), use_tqdm=False)
    assert not llm.has_unfinished()


# ---- chat ------------------------------------------------------------------------------------------

def test_chat_applies_the_template_and_generates():
    llm = LLM(TINY_MODEL_DIR, load_format="dummy", device="cpu")
    conversations = [[{"role": "user", "content": "Hello there"}],
                     [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why?"}]]
    params = SamplingParams(temperature=0, max_tokens=6, n=2)
    outs = llm.chat(conversations, params, use_tqdm=False)
    want = llm.generate([llm.encode_chat(c) for c in conversations], params, use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == [w.prompt_token_ids for w in want]
    assert [[c.token_ids for c in o.outputs] for o in outs] == [[c.token_ids for c in w.outputs] for w in want]
    assert outs[0].prompt_token_ids != llm.tokenizer.encode("Hello there")  # the template wrapped it
    single = llm.chat(conversations[0], SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)
    assert len(single) == 1 and single[0].token_ids == outs[0].token_ids
