"""n > 1, beam search, penalties and cumulative logprobs on the GPU (run on a GPU machine): the decode graph's
in-graph sampler and token logprobs against eager steps, beams and penalties against transformers, and a
plain batch still sampled inside the decode graph."""
from __future__ import annotations

import gc

import pytest
import torch

from engine import LLM, BeamSearchParams, SamplingParams
from tests.breadth_helpers import hf_beams
from tests.conftest import make_checkpoint

pytestmark = pytest.mark.gpu
MAX_NEW = 12
PROMPTS = [[5, 17, 300, 42, 9, 9, 1], [7] * 11, [100, 200, 300, 400, 5, 6, 7, 8, 9], [3] * 40]


@pytest.fixture(scope="module")
def gpu_checkpoint(tmp_path_factory):
    shape = dict(hidden_size=512, intermediate_size=1024, num_hidden_layers=4, initializer_range=0.05, head_dim=64,
                 num_attention_heads=8, num_key_value_heads=2)
    return make_checkpoint("qwen3", tmp_path_factory.mktemp("gpu-breadth"), **shape)


def test_cumulative_logprobs_of_graph_steps_equal_eager_steps(gpu_checkpoint, free_gpu):
    """The decode graph's token-logprob kernel against the eager path's, on plain (in-graph) and penalised
    (the graph's logits, then the sampler) batches."""
    runs = [SamplingParams(temperature=0, max_tokens=MAX_NEW), SamplingParams(temperature=0.8, max_tokens=MAX_NEW),
            SamplingParams(temperature=0, max_tokens=MAX_NEW, frequency_penalty=0.5, logit_bias={13: 2.0})]
    results = {}
    for eager in (True, False):
        llm = LLM(str(gpu_checkpoint), device="cuda", dtype="bfloat16", max_model_len=512, max_num_seqs=4,
                  enforce_eager=eager)
        results[eager] = [[(o.token_ids, o.cumulative_logprob) for o in llm.generate(PROMPTS, sp, use_tqdm=False)]
                          for sp in runs]
        del llm
        gc.collect()
    for graph_run, eager_run in zip(results[False], results[True]):
        assert [t for t, _ in graph_run] == [t for t, _ in eager_run]
        assert [lp for _, lp in graph_run] == pytest.approx([lp for _, lp in eager_run], abs=1e-3)


def test_a_plain_batch_samples_inside_the_decode_graph(gpu_checkpoint, monkeypatch, free_gpu):
    """Requests without penalties, biases or min_tokens pay nothing: every decode step of a plain batch
    takes the graph's own sampler (Sampler.sample is never called after the prefill); a penalised request
    takes the graph's logits to the sampler."""
    llm = LLM(str(gpu_checkpoint), device="cuda", dtype="bfloat16", max_model_len=512, max_num_seqs=4)
    calls = []
    sample = llm.runner.sampler.sample
    monkeypatch.setattr(llm.runner.sampler, "sample", lambda *a, **k: calls.append(1) or sample(*a, **k))
    llm.generate(PROMPTS, SamplingParams(temperature=0.8, max_tokens=MAX_NEW, n=2), use_tqdm=False)
    plain = len(calls)
    llm.generate(PROMPTS, SamplingParams(temperature=0.8, max_tokens=MAX_NEW, presence_penalty=1.0), use_tqdm=False)
    assert plain <= len(PROMPTS)  # prefill steps only
    assert len(calls) - plain >= MAX_NEW - 1


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_beams_equal_transformers_on_gpu(gpu_checkpoint, dtype, free_gpu):
    """fp32: the same beams as transformers; bf16: rounding differs between implementations, so most
    prompts' best beam must agree."""
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(gpu_checkpoint, dtype=getattr(torch, dtype)).cuda().eval()
    llm = LLM(str(gpu_checkpoint), device="cuda", dtype=dtype, max_model_len=512, max_num_seqs=8)
    agree = 0
    for width, penalty in ((2, 1.0), (4, 0.5)):
        outs = llm.beam_search(PROMPTS, BeamSearchParams(width, MAX_NEW, length_penalty=penalty), use_tqdm=False)
        for prompt, out in zip(PROMPTS, outs):
            want = hf_beams(hf, prompt, width, MAX_NEW, penalty, 2)
            same = [c.token_ids for c in out.outputs] == [t for t, _ in want]
            agree += same
            if dtype == "float32":
                assert same
                assert [c.cumulative_logprob for c in out.outputs] == pytest.approx([lp for _, lp in want], rel=1e-3)  # GPU fp32 sums in its own order
    assert agree >= (2 * len(PROMPTS)) // 2
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks


def test_repetition_penalty_equals_transformers_on_gpu(gpu_checkpoint, free_gpu):
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(gpu_checkpoint, dtype=torch.float32).cuda().eval()
    llm = LLM(str(gpu_checkpoint), device="cuda", dtype="float32", max_model_len=512)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_NEW, repetition_penalty=1.4,
                                                ignore_eos=True), use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        ids = torch.tensor([prompt], device="cuda")
        want = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=MAX_NEW,
                           repetition_penalty=1.4, eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        assert out.token_ids == want
