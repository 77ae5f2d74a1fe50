import pytest
import torch

from engine import LLM, SamplingParams
from engine.sampling.sampler import SamplingTensors, sample

V = 50


def tensors(n, temperature=1.0, top_k=-1, top_p=1.0, min_p=0.0, generators=None):
    return SamplingTensors(
        temperatures=torch.full((n,), temperature), top_ks=torch.full((n,), top_k if top_k > 0 else V),
        top_ps=torch.full((n,), top_p), min_ps=torch.full((n,), min_p),
        generators=generators or [None] * n, all_greedy=temperature == 0,
        needs_filter=top_k > 0 or top_p < 1 or min_p > 0)


@pytest.fixture
def logits():
    torch.manual_seed(0)
    return torch.randn(1, V).repeat(4000, 1)


def test_top_k_never_leaves_the_k_best(logits):
    allowed = set(logits[0].topk(5).indices.tolist())
    got = set(sample(logits, tensors(len(logits), top_k=5)).tolist())
    assert got <= allowed and len(got) > 1


def test_top_p_never_leaves_the_nucleus(logits):
    probs = logits[0].softmax(-1)
    order = probs.argsort(descending=True)
    mass_before = probs[order].cumsum(0) - probs[order]
    allowed = set(order[mass_before < 0.5].tolist())
    got = set(sample(logits, tensors(len(logits), top_p=0.5)).tolist())
    assert got <= allowed and len(got) > 1


def test_min_p_never_samples_below_the_floor(logits):
    probs = logits[0].softmax(-1)
    allowed = set(torch.nonzero(probs >= 0.2 * probs.max()).flatten().tolist())
    got = set(sample(logits, tensors(len(logits), min_p=0.2)).tolist())
    assert got <= allowed and len(got) > 1


def test_greedy_is_argmax(logits):
    assert set(sample(logits, tensors(len(logits), temperature=0)).tolist()) == {int(logits[0].argmax())}


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def llm(qwen3_checkpoint, request):
    return LLM(str(qwen3_checkpoint), device="cpu", kvcache_block_size=8, async_scheduling=request.param)


PROMPTS = [[11, 12, 13, 14], [200, 201], [7] * 30]


def test_same_seed_gives_same_tokens(llm):
    sp = SamplingParams(temperature=1.0, top_k=40, seed=1234, max_tokens=16)
    first = [o.token_ids for o in llm.generate(PROMPTS, sp, use_tqdm=False)]
    mixed = [sp, SamplingParams(temperature=1.0, max_tokens=16), sp]   # other requests share the batch
    second = [o.token_ids for o in llm.generate(PROMPTS, mixed, use_tqdm=False)]
    assert first[0] == second[0] and first[2] == second[2]
    other = llm.generate(PROMPTS, SamplingParams(temperature=1.0, top_k=40, seed=99, max_tokens=16), use_tqdm=False)
    assert [o.token_ids for o in other] != first


def test_stop_token_ids_end_generation_at_the_stop(llm):
    base = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0]
    ids = base.token_ids
    cut = next(i for i in range(2, len(ids)) if ids[i] not in ids[:i])
    out = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[ids[cut]]),
                       use_tqdm=False)[0]
    assert out.finish_reason == "stop"
    assert out.token_ids == ids[: cut + 1]
    assert out.text == llm.tokenizer.decode(ids[:cut], skip_special_tokens=True)


def test_stop_strings_cut_the_text_before_the_stop(llm):
    base = llm.generate([PROMPTS[1]], SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0]
    stop = base.text[len(base.text) // 2: len(base.text) // 2 + 3]
    assert stop.strip()
    out = llm.generate([PROMPTS[1]], SamplingParams(temperature=0, max_tokens=24, stop=[stop]), use_tqdm=False)[0]
    assert out.finish_reason == "stop"
    assert stop not in out.text
    assert out.text == base.text[: base.text.find(stop)]
    assert out.token_ids == base.token_ids[: len(out.token_ids)] and len(out.token_ids) < len(base.token_ids)


def test_length_finish_and_logprobs(llm):
    out = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=5, logprobs=3), use_tqdm=False)[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 5
    assert len(out.logprobs) == 5
    for tok, lp in zip(out.token_ids, out.logprobs):
        assert lp["token_id"] == tok and lp["logprob"] <= 0
        assert len(lp["top"]) == 3 and max(lp["top"], key=lp["top"].get) == tok  # greedy: the best one


@pytest.mark.parametrize("kwargs, field", [
    ({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"), ({"top_p": 1.5}, "top_p"),
    ({"top_k": 0}, "top_k"), ({"min_p": 2}, "min_p"), ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 2.5}, "max_tokens"), ({"logprobs": 99}, "logprobs"), ({"stop": [""]}, "stop"),
    ({"stop_token_ids": [-3]}, "stop_token_ids"), ({"temperature": float("nan")}, "temperature"),
    ({"seed": "x"}, "seed"), ({"ignore_eos": "yes"}, "ignore_eos"),
])
def test_invalid_sampling_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_graph_tokens_and_logprobs_come_back_from_one_buffer():
    """The decode graph's ids and logprobs share one buffer ([B] int64, then [B] float32); a step reads back
    its first n of each, from host buffers a ring reuses, however many steps have been taken."""
    from engine.sampling.pinned import PinnedRing
    from engine.sampling.sampler import SampledTokens

    bs, ring = 8, PinnedRing(torch.device("cpu"))
    sampled = torch.zeros(bs * 12, dtype=torch.uint8)
    ids, logprobs = sampled[: 8 * bs].view(torch.int64), sampled[8 * bs:].view(torch.float32)
    pending = []
    for step, n in enumerate([3, 8, 1, 5, 8, 2]):
        ids.copy_(torch.arange(bs) + 1000 * step)
        logprobs.copy_(-torch.arange(bs, dtype=torch.float32) - step / 8)
        pending.append((step, n, SampledTokens.of_graph(sampled, n, ring)))
        if len(pending) == 2:  # the engine collects a step once the next one is launched
            step0, n0, tokens = pending.pop(0)
            got_ids, (got_logprobs, top, top_ids) = tokens.result()
            assert got_ids == [1000 * step0 + i for i in range(n0)]
            assert got_logprobs == [-i - step0 / 8 for i in range(n0)]
            assert top is None and top_ids is None


def test_penalty_kernel_equals_the_torch_penalties_under_interpreter():
    """engine/kernels/penalties.py, the GPU's penalties, leaves the logits the torch path leaves: repetition
    above and below 1 on positive and negative logits, frequency and presence of either sign, counts and
    prompt tokens from their own TokenCounts rows, other rows untouched, vocabularies off the block."""
    pytest.importorskip("triton")
    from tests.interpreter import REPO, run_under_interpreter
    cases = run_under_interpreter(REPO / "tests" / "penalties_cases.py")
    assert set(cases) == {"vocab_37", "vocab_5000"}
    for case in cases.values():
        assert case["max_diff"] == 0.0 and case["untouched_equal"] and case["changed"] > 0, cases


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_penalty_kernel_equals_the_torch_penalties_on_gpu():
    from tests.penalties_cases import penalty_case
    for vocab in (37, 5000, 151936):
        case = penalty_case("cuda", vocab)
        assert case["max_diff"] <= 1e-6 and case["untouched_equal"] and case["changed"] > 0, (vocab, case)
