"""LLM.beam_search gives transformers' beams: generate(num_beams=W, num_return_sequences=W, length_penalty=L,
early_stopping=True, do_sample=False) on the same checkpoint (fp32, CPU), the same beams in the same order
with the same cumulative logprobs, with the EOS out of reach and in reach, also through the prefix cache and
a KV cache small enough to preempt beams."""
from __future__ import annotations

import pytest

from engine import LLM, BeamSearchParams
from tests.breadth_helpers import checkpoint_with_eos, hf_beams, load_hf

MAX_NEW = 12
PROMPTS = [[5, 17, 300, 42], [7] * 11, [100, 200, 300, 400, 5, 6, 7, 8, 9]]
WIDTHS = (2, 4)
LENGTH_PENALTIES = (1.0, 0.0, 2.0, -1.0)


@pytest.fixture(scope="module")
def setup(qwen3_checkpoint, tmp_path_factory):
    """(checkpoint, its EOS) twice: the EOS out of reach, and a token the beams meet early made the EOS;
    with the transformers model (the weights are the same) and a cache of its beams."""
    model = load_hf(qwen3_checkpoint)
    far = LLM(str(qwen3_checkpoint), device="cpu", kvcache_block_size=4)
    beams = far.beam_search(PROMPTS, BeamSearchParams(4, MAX_NEW), use_tqdm=False)
    eos = beams[2].outputs[1].token_ids[2]  # a token the third prompt's beams take early
    near = checkpoint_with_eos(qwen3_checkpoint, eos, tmp_path_factory.mktemp("eos-near"))
    return {"far": (qwen3_checkpoint, 2), "near": (near, eos)}, model, {}


def expected(setup, reach: str, width: int, length_penalty: float, prompts=PROMPTS):
    checkpoints, model, cache = setup
    _, eos = checkpoints[reach]
    key = (reach, width, length_penalty, tuple(map(tuple, prompts)))
    if key not in cache:
        cache[key] = [hf_beams(model, p, width, MAX_NEW, length_penalty, eos) for p in prompts]
    return cache[key]


def assert_same_beams(outs, want) -> None:
    for out, hf in zip(outs, want, strict=True):
        assert [c.token_ids for c in out.outputs] == [tokens for tokens, _ in hf]
        for c, (_, logprob) in zip(out.outputs, hf):
            assert c.cumulative_logprob == pytest.approx(logprob, abs=2e-4)
        assert [c.index for c in out.outputs] == list(range(len(hf)))
        assert out.token_ids == out.outputs[0].token_ids and out.cumulative_logprob == out.outputs[0].cumulative_logprob


@pytest.fixture(scope="module")
def engines(setup):
    checkpoints, _, _ = setup
    return {reach: LLM(str(path), device="cpu", kvcache_block_size=4) for reach, (path, _) in checkpoints.items()}


@pytest.mark.parametrize("reach", ["far", "near"])
@pytest.mark.parametrize("width", WIDTHS)
def test_beams_equal_transformers_beam_search(setup, engines, reach, width):
    llm = engines[reach]
    finished_early = 0
    for length_penalty in LENGTH_PENALTIES:
        outs = llm.beam_search(PROMPTS, BeamSearchParams(width, MAX_NEW, length_penalty=length_penalty),
                               use_tqdm=False)
        assert_same_beams(outs, expected(setup, reach, width, length_penalty))
        finished_early += sum(c.finish_reason == "stop" for o in outs for c in o.outputs)
        assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks
    assert (finished_early > 0) == (reach == "near")  # the near EOS ends hypotheses; the far one never does


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_beams_equal_transformers_through_prefix_cache_and_preemption(setup, async_scheduling):
    checkpoints, _, _ = setup
    path, _ = checkpoints["near"]
    prompts = PROMPTS + [PROMPTS[2] + [11, 12, 13], PROMPTS[2] + [21]]  # the cache serves their shared blocks
    llm = LLM(str(path), device="cpu", kvcache_block_size=4, num_kvcache_blocks=24, max_model_len=64,
              async_scheduling=async_scheduling)
    outs = llm.beam_search(prompts, BeamSearchParams(4, MAX_NEW, length_penalty=1.0), use_tqdm=False)
    assert llm.scheduler.num_preemptions > 0 and llm.block_manager.num_cache_hits > 0
    assert_same_beams(outs, expected(setup, "near", 4, 1.0, prompts))
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks


def test_beam_search_beside_sampled_requests_and_an_abort(engines):
    llm = engines["far"]
    alone = llm.beam_search([PROMPTS[0]], BeamSearchParams(2, MAX_NEW), use_tqdm=False)[0]
    from engine import SamplingParams
    beam_id = llm.add_request(PROMPTS[0], BeamSearchParams(2, MAX_NEW))
    gone_id = llm.add_request(PROMPTS[1], BeamSearchParams(4, MAX_NEW))
    llm.add_request(PROMPTS[2], SamplingParams(temperature=0.8, n=2, max_tokens=MAX_NEW))
    done = {}
    for _ in range(3):
        llm.step()
    assert llm.abort(gone_id)
    while llm.has_unfinished():
        for out in llm.step().finished:
            done[out.request_id] = out
    assert [c.token_ids for c in done[beam_id].outputs] == [c.token_ids for c in alone.outputs]
    assert done[gone_id].finish_reason == "abort"
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks


@pytest.mark.parametrize("kwargs, field", [
    (dict(beam_width=0, max_tokens=4), "beam_width"), (dict(beam_width=2, max_tokens=0), "max_tokens"),
    (dict(beam_width=2.5, max_tokens=4), "beam_width"), (dict(beam_width=2, max_tokens=4, length_penalty="x"),
                                                         "length_penalty"),
])
def test_bad_beam_search_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        BeamSearchParams(**kwargs)


def test_beams_wider_than_the_engine_are_refused_in_one_line(engines):
    with pytest.raises(ValueError, match="beam_width=8 needs 8 sequences at once; max_num_seqs is 4"):
        LLM(str(engines["far"].config.model_dir), device="cpu", max_num_seqs=4).beam_search(
            [[1, 2]], BeamSearchParams(8, 4), use_tqdm=False)
