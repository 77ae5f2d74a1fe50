"""The real worker and the real engine (tiny model, random weights, CPU) behind real redis-servers."""
from __future__ import annotations

import threading
import time

import pytest
import redis

from engine import SamplingParams
from producer import Client
from producer import protocol as p
from queue_helpers import new_queue, tiny_engine, worker_thread
from queue_helpers import url  # noqa: F401 - the fixture: a module's Redis, on each server

GREEDY = {"temperature": 0.0, "max_tokens": 12}


@pytest.fixture(scope="module", params=[False, True], ids=["sync-engine", "async-engine"])
def engine(request):
    # async scheduling is the engine's default on GPUs: the worker must drive both the same way
    return tiny_engine(max_num_seqs=16, async_scheduling=request.param)


@pytest.fixture(scope="module")
def reference():
    """A second engine with the same (seeded) random weights, for LLM.generate's answers."""
    return tiny_engine()


@pytest.fixture
def client(url):
    with Client(url, new_queue()) as c:
        yield c


def test_text_chat_and_token_id_jobs_match_llm_generate(url, client, engine, reference):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a color."}]
    with worker_thread(url, client.keys.queue, engine):
        ids = [client.submit("The capital of France is", sampling=GREEDY),
               client.submit(messages=messages, sampling=GREEDY),
               client.submit(prompt_token_ids=[11, 22, 33, 44, 55], sampling=GREEDY)]
        results = [client.result(i, timeout=60) for i in ids]
    prompts = ["The capital of France is", reference.encode_chat(messages), [11, 22, 33, 44, 55]]
    expected = reference.generate(prompts, SamplingParams(**GREEDY), use_tqdm=False)
    for res, exp, job_id in zip(results, expected, ids):
        assert res.status == "succeeded" and res.job_id == job_id
        assert res.token_ids == exp.token_ids
        assert res.text == exp.text
        assert res.finish_reason == exp.finish_reason
        assert res.usage.prompt_tokens == len(exp.prompt_token_ids)
        assert res.usage.completion_tokens == len(exp.token_ids)
        assert res.attempts == 1


def test_stream_deltas_concatenate_to_the_final_text(url, client, engine):
    # long enough, and written every step, that a loaded machine's slow flush still leaves several pieces
    sampling = {"temperature": 1.0, "seed": 7, "max_tokens": 1000, "ignore_eos": True}
    with worker_thread(url, client.keys.queue, engine, stream_interval=0):
        job_id = client.submit("Tell me something", sampling=sampling)
        deltas = list(client.stream(job_id, timeout=60))
        result = client.result(job_id, timeout=60)
    assert deltas[-1].finished and deltas[-1].status == "succeeded"
    assert len(deltas) > 2  # tokens arrived in several pieces while generating
    assert "".join(d.text for d in deltas) == result.text
    assert [t for d in deltas for t in d.token_ids] == result.token_ids
    indices = [d.index for d in deltas]
    assert indices == [sum(len(d.token_ids) for d in deltas[:i]) for i in range(len(deltas))]


def test_a_job_without_streaming_gets_one_final_delta_with_everything(url, client, engine):
    with worker_thread(url, client.keys.queue, engine):
        job_id = client.submit("quiet", sampling={**GREEDY, "max_tokens": 30}, stream=False)
        result = client.result(job_id, timeout=60)
    [delta] = list(client.stream(job_id, timeout=5))
    assert delta.finished and delta.text == result.text and delta.token_ids == result.token_ids
    assert len(result.token_ids) == 30


def test_finished_jobs_expire_and_stream_replays_the_result_once_deltas_are_gone(url, client, engine):
    with worker_thread(url, client.keys.queue, engine, result_ttl=7200):
        job_id = client.submit("expire me", sampling=GREEDY)
        result = client.result(job_id, timeout=60)
    assert 7000 < client.redis.ttl(client.keys.job(job_id)) <= 7200
    assert 0 < client.redis.ttl(client.keys.tokens(job_id)) <= p.TOKENS_TTL_S
    client.redis.delete(client.keys.tokens(job_id))  # as if its TTL had passed
    [delta] = list(client.stream(job_id, timeout=5))
    assert delta.finished and delta.text == result.text and delta.token_ids == result.token_ids


def test_a_reader_that_reconnects_mid_stream_resumes_without_gaps(url, client, engine):
    # a writer held up by a busy machine sends everything after the prefill's token as one delta,
    # so the reader leaves after the first: the one delta that is certain to come mid-generation
    sampling = {"temperature": 1.0, "seed": 3, "max_tokens": 400, "ignore_eos": True}
    with worker_thread(url, client.keys.queue, engine):
        job_id = client.submit(prompt_token_ids=[5, 6, 7], sampling=sampling)
        first = []
        for delta in client.stream(job_id, timeout=60):
            first.append(delta)
            break  # the reader goes away mid-generation
        assert not first[-1].finished
        with Client(client.url, client.keys.queue) as reconnected:
            rest = list(reconnected.stream(job_id, after=first[-1].id, timeout=60))
        result = client.result(job_id, timeout=60)
    deltas = first + rest
    assert [t for d in deltas for t in d.token_ids] == result.token_ids
    assert "".join(d.text for d in deltas) == result.text
    assert all(b.index == a.index + len(a.token_ids) for a, b in zip(deltas, deltas[1:]))


def test_cancel_mid_generation_aborts_and_frees_every_kv_block(url, client, engine):
    bm = engine.block_manager
    with worker_thread(url, client.keys.queue, engine):
        # 4,000 tokens: still running when the cancel comes, even where the stream lags the engine by seconds
        job_id = client.submit(prompt_token_ids=list(range(1, 40)),
                               sampling={"max_tokens": 4000, "ignore_eos": True, "temperature": 0})
        for delta in client.stream(job_id, timeout=60):
            if delta.index >= 10:
                break
        assert bm.num_free_blocks < bm.num_blocks  # the job holds blocks while it runs
        assert client.cancel(job_id)
        result = client.result(job_id, timeout=30)
        assert result.status == "cancelled" and result.finish_reason == "abort"
        assert 10 <= len(result.token_ids) < 4000
        assert list(client.stream(job_id, timeout=5))[-1].status == "cancelled"
        assert bm.num_free_blocks == bm.num_blocks
    assert client.status(job_id).status == "cancelled"


def test_a_job_past_its_deadline_expires_without_running(url, client, engine):
    late = client.submit("too late", sampling=GREEDY, deadline_s=0.05)
    in_time = client.submit("in time", sampling=GREEDY, deadline_s=600)
    time.sleep(0.2)  # no worker yet: the first job's deadline passes while it is queued
    with worker_thread(url, client.keys.queue, engine):
        expired = client.result(late, timeout=30)
        ok = client.result(in_time, timeout=30)
    assert expired.status == "expired" and expired.token_ids == [] and expired.attempts == 0
    assert "deadline" in expired.error
    assert ok.status == "succeeded" and ok.token_ids


def test_a_duplicate_job_id_runs_once_and_gets_one_result(url, client, engine):
    client.submit("once", job_id="dup-1", sampling=GREEDY)
    client.submit("twice", job_id="dup-1", sampling=GREEDY)
    # a producer that bypasses the client and adds the same id again by hand
    job = p.JobSpec(prompt="raw", sampling=p.Sampling(**GREEDY)).model_dump_json()
    client.redis.xadd(client.keys.jobs(0), {"job_id": "dup-1", "job": job})
    with worker_thread(url, client.keys.queue, engine):
        result = client.result("dup-1", timeout=30)
        _wait_until_acked(client)
    feed = client.redis.xrange(client.keys.results)
    assert [f[b"job_id"] for _, f in feed] == [b"dup-1"]
    assert result.attempts == 1 and result.usage.prompt_tokens == len(engine.tokenizer.encode("once"))


def test_every_waiter_of_a_running_job_wakes_with_its_result(url, client, engine):
    job_id = client.submit("wait for me", sampling={"max_tokens": 40, "temperature": 0, "ignore_eos": True})
    got = []
    waiters = [threading.Thread(target=lambda: got.append(client.result(job_id, timeout=60).text)) for _ in range(3)]
    for t in waiters:
        t.start()
    with worker_thread(url, client.keys.queue, engine):
        for t in waiters:
            t.join()
    assert len(got) == 3 and len(set(got)) == 1


def test_entries_of_a_dead_consumer_are_reclaimed_and_deleted_ones_dropped(url, client, engine):
    ids = client.submit_many([{"prompt_token_ids": [i + 1, i + 2], "sampling": GREEDY} for i in range(3)])
    stream = client.keys.jobs(0)
    _ensure_group(client)
    taken = client.redis.xreadgroup(p.GROUP, "dead-worker", {stream: ">"}, count=10)
    entry_ids = [e for e, _ in taken[0][1]]
    client.redis.xdel(stream, entry_ids[1])  # deleted while pending: 6.2 and 7 report this differently
    with worker_thread(url, client.keys.queue, engine, claim_timeout=0.3):
        results = [client.result(ids[i], timeout=30) for i in (0, 2)]
        _wait_until_acked(client)
    assert [r.status for r in results] == ["succeeded", "succeeded"]
    assert client.status(ids[1]).status == "queued"  # its entry is gone: nothing can run it
    assert client.redis.xpending(stream, p.GROUP)["pending"] == 0


def test_a_running_job_is_not_stolen_while_its_worker_lives(url, client, engine):
    other_engine = tiny_engine(max_num_seqs=4)
    # the generation outlasts the claim timeout several times over; a heartbeat is due every 0.25 s
    job_id = client.submit(prompt_token_ids=[1, 2, 3],
                           sampling={"max_tokens": 1500, "ignore_eos": True, "temperature": 0})
    with worker_thread(url, client.keys.queue, engine, claim_timeout=1.0) as owner:
        result = None
        with worker_thread(url, client.keys.queue, other_engine, claim_timeout=1.0):
            result = client.result(job_id, timeout=120)
    assert result.status == "succeeded" and len(result.token_ids) == 1500
    assert result.attempts == 1 and result.worker == owner.settings.worker_name
    assert client.redis.xlen(client.keys.results) == 1


def test_a_job_delivered_too_often_is_dead_lettered_and_can_be_requeued(url, client, engine):
    job_id = client.submit("poison?", sampling=GREEDY)
    stream = client.keys.jobs(0)
    _ensure_group(client)
    [(entry_id, _)] = client.redis.xreadgroup(p.GROUP, "crashy", {stream: ">"})[0][1]
    for _ in range(2):  # three deliveries to workers that died; the worker's reclaim is the fourth
        client.redis.xclaim(stream, p.GROUP, "crashy", 0, [entry_id])
    client.redis.hset(client.keys.job(job_id), "last_error", "CUDA error: an illegal memory access")
    with worker_thread(url, client.keys.queue, engine, claim_timeout=0.2, max_deliveries=3):
        failed = client.result(job_id, timeout=30)
        [dead] = client.dead_letters()
        assert failed.status == "failed" and "delivered 4 times" in failed.error
        assert "illegal memory access" in failed.error
        assert dead.job_id == job_id and dead.deliveries == 4 and dead.error == failed.error
        assert p.JobSpec.model_validate_json(dead.job).prompt == "poison?"
        assert client.requeue() == 1
        again = client.result(job_id, timeout=30)
    assert again.status == "succeeded" and again.attempts == 1
    assert client.dead_letters() == []


def test_a_job_that_fails_in_the_engine_does_not_disturb_the_others(url, client, engine):
    too_long = [i % 500 + 1 for i in range(engine.config.max_model_len + 5)]
    with worker_thread(url, client.keys.queue, engine):
        ids = client.submit_many([{"prompt_token_ids": [1, 2], "sampling": GREEDY},
                                  {"prompt_token_ids": too_long, "sampling": GREEDY},
                                  {"prompt_token_ids": [1, 999999], "sampling": GREEDY},
                                  {"prompt": "fine", "sampling": GREEDY}])
        results = [client.result(i, timeout=30) for i in ids]
    assert [r.status for r in results] == ["succeeded", "failed", "failed", "succeeded"]
    assert f"max_model_len is {engine.config.max_model_len}" in results[1].error
    assert "outside the vocabulary" in results[2].error


def test_drain_with_no_time_left_hands_running_jobs_back(url, client, engine):
    # 1,500 tokens: both still run when the worker stops, even where the stream lags the engine
    sampling = {"max_tokens": 1500, "ignore_eos": True, "temperature": 0}
    ids = client.submit_many([{"prompt_token_ids": [3, 4, 5 + i], "sampling": sampling} for i in range(2)])
    with worker_thread(url, client.keys.queue, engine, drain_timeout=0) as first:
        for delta in client.stream(ids[0], timeout=60):
            if delta.index >= 5:
                break
    assert first.in_flight.jobs() == []
    assert [client.status(i).status for i in ids] == ["queued", "queued"]
    assert client.redis.xlen(client.keys.jobs(0)) == 2
    assert client.redis.xpending(client.keys.jobs(0), p.GROUP)["pending"] == 0
    with worker_thread(url, client.keys.queue, engine):
        results = [client.result(i, timeout=120) for i in ids]
    assert [r.attempts for r in results] == [2, 2] and all(r.status == "succeeded" for r in results)
    deltas = list(client.stream(ids[0], timeout=5))
    restart = [i for i, d in enumerate(deltas) if d.restart]
    assert restart, "the second attempt announces itself on the token stream"
    after = deltas[restart[-1]:]
    assert [t for d in after for t in d.token_ids] == results[0].token_ids


def test_the_worker_reports_to_its_metrics(url, client, engine):
    from monitoring.metrics import Metrics

    metrics = Metrics(queue=client.keys.queue, model="tiny")
    client.redis.xadd(client.keys.jobs(0), {"job_id": "broken", "job": "{"})
    ids = client.submit_many([{"prompt": "a", "sampling": GREEDY}, {"prompt": "b", "sampling": GREEDY}])
    with worker_thread(url, client.keys.queue, engine, metrics=metrics):
        for job_id in [*ids, "broken"]:
            client.result(job_id, timeout=30)
        _wait_until_acked(client)

    def value(name: str, **labels) -> float:
        return metrics.registry.get_sample_value(name, {"queue": client.keys.queue, "model_name": "tiny", **labels})
    assert value("redline_jobs_received_total", source="redline") == 3
    assert value("redline_jobs_completed_total", status="succeeded", source="redline") == 2
    assert value("redline_jobs_completed_total", status="failed", source="redline") == 1
    assert value("redline_request_success_total", finished_reason="length") == 2
    assert value("redline_worker_heartbeat_timestamp_seconds") > 0


def _ensure_group(client: Client) -> None:
    for stream in client.keys.all_jobs():
        try:
            client.redis.xgroup_create(stream, p.GROUP, id="0", mkstream=True)
        except redis.ResponseError:
            pass


def _wait_until_acked(client: Client, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while any(client.redis.xlen(s) for s in client.keys.all_jobs()):
        assert time.monotonic() < deadline, "entries were not acked and deleted"
        time.sleep(0.02)


def test_the_worker_logs_its_kv_cache_capacity_at_start(url, client, engine, caplog):
    caplog.set_level("INFO", logger="redline.worker")
    with worker_thread(url, client.keys.queue, engine):
        pass
    bm, config = engine.block_manager, engine.config
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("KV cache:")]
    assert lines == [f"KV cache: {bm.num_blocks} blocks of {config.kvcache_block_size} tokens "
                     f"({bm.num_blocks * config.kvcache_block_size} tokens), room for "
                     f"{bm.num_blocks * config.kvcache_block_size / config.max_model_len:.1f} sequences of "
                     f"max_model_len {config.max_model_len} at once (max_num_seqs {config.max_num_seqs})"], lines
