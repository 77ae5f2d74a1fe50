"""Sampling per vocabulary shard under tensor parallelism: every rank's best (score, token id) per row,
combined, is the unsharded token (greedy: torch.argmax, ties included; Gumbel-max: the same noise per
column), and steps that need whole rows (logprobs, top-k) still gather the logits.

Run as a script, the kernel's sharded cases print JSON (the CPU test runs them under the Triton interpreter).
"""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.layers.embed_head import ParallelLMHead
from engine.layers.parallel import TPGroup
from engine.sampling.sampler import pick_token, shard_best

sys.path.insert(0, str(Path(__file__).parent))
from interpreter import run_under_interpreter  # noqa: E402
from test_tp import TIGHT_CACHE, assert_ranks_gone, generate_ids, tp_prompts  # noqa: E402

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def slice_bounds(vocab: int, size: int) -> list[tuple[int, int]]:
    """Each rank's [start, end) of the vocabulary, as VocabParallelEmbedding splits it (the last one short)."""
    local = -(-vocab // size)
    return [(min(r * local, vocab), min((r + 1) * local, vocab)) for r in range(size)]


def sharded(logits: torch.Tensor, size: int, temperatures=None, seed: int = 0) -> list[int]:
    vocab = logits.shape[1]
    candidates = [shard_best(logits[:, a:b], temperatures, seed, a, vocab) for a, b in slice_bounds(vocab, size)]
    return pick_token(torch.stack(candidates)).tolist()


def tied_logits(vocab: int = 37) -> torch.Tensor:
    """Random rows, then rows whose maximum is tied across shards (in the last column too) and within
    one, an all -inf row, a row whose first shard is all -inf, and a row of many ties (as bf16 rounds)."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(10, vocab, generator=gen)
    logits[4, [20, 5, 36]] = 9.0  # the lowest in the first shard
    logits[5, [30, 19]] = 9.0     # both past the first shard (in two shards of three)
    logits[6, [1, 2]] = 9.0
    logits[7] = float("-inf")
    logits[8, :25] = float("-inf")
    logits[9] = logits[9].round()
    return logits.to(torch.bfloat16)


@pytest.mark.parametrize("size", [2, 3])
def test_sharded_greedy_is_torch_argmax_including_ties_across_shards(size):
    logits = tied_logits()
    assert sharded(logits, size) == logits.argmax(dim=-1).tolist()
    assert sharded(logits, size)[4:6] == [5, 19]


@pytest.mark.parametrize("size", [2, 3])
def test_lm_head_slices_leave_out_the_padding_past_the_vocabulary(size):
    """The last rank's padded columns have zero logits; rows of negative logits would pick them."""
    vocab, hidden = 37, 8
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(vocab, hidden, generator=gen)
    weight[:, 0] = weight[:, 0].abs() + 1
    rows = torch.randn(6, hidden, generator=gen)
    rows[:3, 0] = -100.0  # every logit of these rows negative: the padding's zeros would win
    full = rows @ weight.T
    assert bool((full[:3] < 0).all())
    candidates = []
    for rank in range(size):
        head = ParallelLMHead(vocab, hidden, TPGroup(rank, size))
        head.weight_loader(head.weight, weight)
        candidates.append(shard_best(head.local_logits(rows), None, 0, head.vocab_start, vocab))
    assert pick_token(torch.stack(candidates)).tolist() == full.argmax(dim=-1).tolist()


def test_pick_token_prefers_any_score_over_nan_and_stays_a_token_of_the_row():
    nan, inf = float("nan"), float("inf")
    candidates = torch.tensor([[[nan, 3.0], [-inf, 0.0]],
                               [[1.0, 20.0], [-inf, 20.0]]], dtype=torch.float64)
    assert pick_token(candidates).tolist() == [20, 0]


@pytest.mark.parametrize("size", [2, 3])
def test_sharded_gumbel_with_torch_ops_draws_the_unsharded_tokens(size):
    """Without the kernel (CPU), every rank draws the whole row's noise from the step's seed."""
    logits = tied_logits()
    temperatures = torch.tensor([1.0, 0.5, 0.0, 2.0, 1.0, 0.0, 1.0, 1.0, 0.7, 0.0])
    unsharded = sharded(logits, 1, temperatures, seed=5)
    assert sharded(logits, size, temperatures, seed=5) == unsharded
    greedy = [i for i, t in enumerate(temperatures.tolist()) if t == 0]
    assert [unsharded[i] for i in greedy] == [logits.argmax(dim=-1)[i].item() for i in greedy]
    assert sharded(logits, size, temperatures, seed=6) != unsharded  # the seed draws the noise


def kernel_cases(device: str, vocab: int, sizes: list[int], layouts: list) -> dict:
    """gumbel_argmax of whole rows, and the best of gumbel_best over each sharding (and split layout)."""
    from engine.kernels.sampling import gumbel_argmax, gumbel_best

    gen = torch.Generator().manual_seed(2)
    logits = (torch.randn(12, vocab, generator=gen) * 2).to(device=device, dtype=torch.bfloat16)
    logits[3, [7, vocab // 2, vocab - 1]] = 20.0
    logits[5] = float("-inf")
    temperatures = torch.tensor([1.0, 0.5, 0.0, 0.0, 2.0, 1.0, 1.5, 0.0, 1.0, 0.8, 1.0, 3.0], device=device)
    results = {"whole": gumbel_argmax(logits, temperatures, 99).tolist(), "argmax": logits.argmax(dim=-1).tolist()}
    for size in sizes:
        for num_splits, block in layouts:
            best = [gumbel_best(logits[:, a:b], temperatures, 99, a, num_splits=num_splits, block=block)
                    for a, b in slice_bounds(vocab, size)]
            candidates = torch.stack([torch.stack([s.double(), i.double()], dim=1) for s, i in best])
            results[f"{size} {num_splits} {block}"] = pick_token(candidates).tolist()
    return results


def assert_shards_give_the_whole_row_tokens(results: dict) -> None:
    whole = results.pop("whole")
    argmax = results.pop("argmax")
    assert [whole[i] for i in (2, 3, 7)] == [argmax[i] for i in (2, 3, 7)]
    assert len(set(whole)) > 4
    for layout, tokens in results.items():
        assert tokens == whole, f"(ranks, num_splits, block) {layout}: {tokens}, not {whole}"


@needs_triton
def test_sharded_gumbel_kernel_draws_the_unsharded_tokens_under_interpreter():
    """Slices start at columns that are no multiple of 4 (37 over 2 and 3 ranks), split or not."""
    assert_shards_give_the_whole_row_tokens(run_under_interpreter(Path(__file__)))


@pytest.mark.gpu
@needs_cuda
def test_sharded_gumbel_kernel_draws_the_unsharded_tokens_on_gpu():
    assert_shards_give_the_whole_row_tokens(kernel_cases("cuda", 151936, [2, 3, 8], [(None, 2048), (1, 2048)]))
    assert_shards_give_the_whole_row_tokens(kernel_cases("cuda", 37, [2, 3], [(None, 8)]))


def count_calls(monkeypatch, obj, name: str) -> list:
    calls = []
    method = getattr(obj, name)

    def counted(*args, **kwargs):
        calls.append(1)
        return method(*args, **kwargs)

    monkeypatch.setattr(obj, name, counted)
    return calls


@pytest.fixture(scope="module")
def engines(qwen3_checkpoint):
    """A TP=1 and a TP=2 engine on CPU (gloo), with a cache small enough to preempt."""
    tp1 = LLM(str(qwen3_checkpoint), **TIGHT_CACHE)
    tp2 = LLM(str(qwen3_checkpoint), tensor_parallel_size=2, **TIGHT_CACHE)
    pids = tp2.runner.worker_pids
    yield tp1, tp2
    tp2.shutdown()
    assert_ranks_gone(pids)


@pytest.mark.timeout(300)
def test_tp2_greedy_and_plain_sampling_take_tokens_per_shard_without_gathering_logits(engines, monkeypatch):
    tp1, tp2 = engines
    prompts = tp_prompts(seed=3)
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    hot = SamplingParams(temperature=1.5, max_tokens=12, ignore_eos=True)
    mixed = [hot if i % 2 else greedy for i in range(len(prompts))]
    gathered = count_calls(monkeypatch, tp2.runner.runner, "compute_logits")
    all_greedy = generate_ids(tp2, prompts, greedy)
    assert all_greedy == generate_ids(tp1, prompts, greedy)
    sampled = generate_ids(tp2, prompts, mixed)
    assert sampled[0::2] == generate_ids(tp1, prompts, mixed)[0::2]  # greedy rows among sampled (the kernel's t = 0)
    assert sampled[1::2] != all_greedy[1::2]  # the noise reached the sampled rows
    assert all(0 <= t < 512 for tokens in sampled for t in tokens)
    assert gathered == []


@pytest.mark.timeout(300)
def test_tp2_logprobs_and_top_k_gather_the_logits_and_equal_tp1(engines, monkeypatch):
    tp1, tp2 = engines
    prompts = tp_prompts(seed=4)[:8]
    params = [SamplingParams(temperature=0, max_tokens=6, logprobs=2),
              SamplingParams(temperature=0.8, top_k=5, seed=7, max_tokens=6)]
    gathered = count_calls(monkeypatch, tp2.runner.runner, "compute_logits")
    for p in params:
        want = tp1.generate(prompts, p, use_tqdm=False)
        got = tp2.generate(prompts, p, use_tqdm=False)
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
        if p.logprobs:
            assert [lp["logprob"] for o in got for lp in o.logprobs] == pytest.approx(
                [lp["logprob"] for o in want for lp in o.logprobs], abs=1e-4)
    assert gathered


@pytest.mark.timeout(300)
def test_tp2_breadth_equals_tp1_with_sharded_cumulative_logprobs(engines):
    """Sharded steps take each token's logprob from every rank's log-sum-exp; n > 1 with penalties and
    biases, and beam search, gather the logits; all as TP=1, through preemption."""
    from engine import BeamSearchParams
    tp1, tp2 = engines
    prompts = tp_prompts(seed=5)[:8]
    plain = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    want, got = (e.generate(prompts, plain, use_tqdm=False) for e in (tp1, tp2))
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.cumulative_logprob for o in got] == pytest.approx([o.cumulative_logprob for o in want], abs=1e-4)
    adjusted = SamplingParams(n=2, temperature=0.8, seed=3, max_tokens=8, frequency_penalty=0.7,
                              repetition_penalty=1.3, logit_bias={5: 4.0}, min_tokens=4)
    beams = BeamSearchParams(2, 6)
    for params in (adjusted, beams):
        want, got = (e.generate(prompts[:4], params, use_tqdm=False) for e in (tp1, tp2))
        assert [[c.token_ids for c in o.outputs] for o in got] == [[c.token_ids for c in o.outputs] for o in want]
    assert tp2.block_manager.num_free_blocks == tp2.block_manager.num_blocks


if __name__ == "__main__":
    import json

    torch.set_num_threads(1)
    print(json.dumps(kernel_cases("cpu", 37, [2, 3], [(None, 8), (1, 64), (3, 8)])))
