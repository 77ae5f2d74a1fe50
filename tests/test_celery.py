"""Celery producers, unchanged: a real Celery app (a producer only: send_task, .get(), revoke, ping) against
real redis-servers and real redline workers serving a Celery queue beside their own streams."""
from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time

import jsonschema
import pytest
from celery import Celery
from celery.exceptions import NotRegistered, TaskRevokedError
from celery.result import AsyncResult

from engine import SamplingParams
from producer import Client
from queue_helpers import (REPO_ROOT, log_of, new_queue, start_worker_process, stop_process, tiny_engine, wait_for,
                           worker_thread)
from queue_helpers import url  # noqa: F401 - the fixture: a module's Redis, on each server
from worker.celery_source import TASK_NAME, priority_level, unacked_key

# Celery's own Redis result backend calls redis-py's deprecated setex on every store
pytestmark = pytest.mark.filterwarnings("ignore:Call to deprecated setex:DeprecationWarning")

GREEDY = {"temperature": 0.0, "max_tokens": 12}
LONG = {"temperature": 0.0, "max_tokens": 1500, "ignore_eos": True}  # seconds on the CPU: time to act mid-run


@pytest.fixture(scope="module")
def engine():
    return tiny_engine(max_num_seqs=16)


@pytest.fixture(scope="module")
def reference():
    """A second engine with the same (seeded) random weights, for LLM.generate's answers."""
    return tiny_engine()


@pytest.fixture
def producer(url):
    app = Celery("producer", broker=url, backend=url, set_as_current=False)
    yield app
    app.close()


@contextlib.contextmanager
def celery_worker(url: str, producer: Celery, engine, metrics=None, **settings):
    """A real worker on a thread serving a fresh Celery queue (and a fresh queue of its own); yields it once
    it answers Celery's ping, so that it hears revokes."""
    with worker_thread(url, new_queue(), engine, metrics, celery_queue=new_queue(), **settings) as worker:
        node = f"redline@{worker.settings.worker_name}"
        wait_for(lambda: producer.control.ping(destination=[node], timeout=0.5), 30, "the worker's pong")
        yield worker


def send(producer: Celery, worker, name: str = TASK_NAME, **options) -> AsyncResult:
    return producer.send_task(name, queue=worker.settings.celery_queue, **options)


def test_send_task_then_get_returns_what_llm_generate_gives(url, producer, engine, reference):
    from monitoring.metrics import Metrics

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a color."}]
    inputs = [{"prompt": "The capital of France is"}, {"messages": messages}, {"prompt_token_ids": [11, 22, 33, 44]}]
    metrics = Metrics(queue="q", model="tiny")
    with celery_worker(url, producer, engine, metrics) as worker:
        sent = [send(producer, worker, kwargs={**i, "sampling": GREEDY}) for i in inputs]
        results = [r.get(timeout=60) for r in sent]
    prompts = ["The capital of France is", reference.encode_chat(messages), [11, 22, 33, 44]]
    expected = reference.generate(prompts, SamplingParams(**GREEDY), use_tqdm=False)
    for r, res, exp in zip(sent, results, expected):
        json.dumps(res)  # a plain JSON-able dict
        assert r.state == "SUCCESS" and res["status"] == "succeeded" and res["job_id"] == f"celery-{r.id}"
        assert res["token_ids"] == exp.token_ids and res["text"] == exp.text
        assert res["finish_reason"] == exp.finish_reason
        assert res["usage"]["prompt_tokens"] == len(exp.prompt_token_ids)
    count = metrics.registry.get_sample_value
    labels = {"queue": "q", "model_name": "tiny"}
    assert count("redline_jobs_received_total", {**labels, "source": "celery"}) == 3
    assert count("redline_jobs_completed_total", {**labels, "status": "succeeded", "source": "celery"}) == 3
    assert count("redline_jobs_received_total", {**labels, "source": "redline"}) == 0


def test_state_moves_from_pending_to_started_to_success(url, producer, engine):
    queue = new_queue()
    r = producer.send_task(TASK_NAME, kwargs={"prompt_token_ids": [5, 6, 7], "sampling": {**LONG, "max_tokens": 400}},
                           queue=queue)
    assert r.state == "PENDING"  # no worker serves the queue yet
    seen = ["PENDING"]
    with worker_thread(url, new_queue(), engine, celery_queue=queue):
        deadline = time.monotonic() + 60
        while seen[-1] != "SUCCESS" and time.monotonic() < deadline:
            state = AsyncResult(r.id, app=producer).state
            if state != seen[-1]:
                seen.append(state)
            time.sleep(0.002)
    assert seen == ["PENDING", "STARTED", "SUCCESS"]
    assert len(r.get(timeout=5)["token_ids"]) == 400


def test_a_job_that_fails_raises_its_error_in_the_producer_and_the_worker_serves_on(url, producer, engine):
    cases = [
        ({"prompt": "x", "sampling": {"max_tokens": 0}}, "sampling.max_tokens: Input should be greater than or equal to 1"),
        ({"prompt_token_ids": [5] * 3000}, "max_model_len"),
        ({"prompt": "x", "messages": [{"role": "user", "content": "y"}]}, "give exactly one of prompt"),
        ({"prompt": "x", "deadline_s": -5}, "deadline_s: Input should be greater than 0"),
    ]
    with celery_worker(url, producer, engine) as worker:
        failing = [send(producer, worker, kwargs=kwargs) for kwargs, _ in cases]
        positional = send(producer, worker, args=["x"])
        unknown = send(producer, worker, name="tasks.add", args=[2, 2])
        fine = send(producer, worker, kwargs={"prompt": "still serving", "sampling": GREEDY, "priority": 1,
                                              "deadline_s": 600})
        for r, (_, words) in zip(failing, cases):
            with pytest.raises(Exception, match=re.escape(words)) as raised:
                r.get(timeout=30)
            assert type(raised.value).__name__ == "JobFailed" and r.state == "FAILURE"
        with pytest.raises(Exception, match="keyword arguments only"):
            positional.get(timeout=30)
        with pytest.raises(NotRegistered, match="'tasks.add' is not registered"):
            unknown.get(timeout=30)
        assert fine.get(timeout=30)["status"] == "succeeded"


def test_celery_kwargs_take_structured_output_as_the_queue_does(url, producer, engine):
    schema = {"type": "object", "additionalProperties": False, "required": ["ok", "n"],
              "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 99}}}
    with celery_worker(url, producer, engine) as worker:
        sent = [send(producer, worker, kwargs={"prompt": f"Item {i}", "sampling": {"json_schema": schema, "seed": i,
                                                                                   "max_tokens": 60}})
                for i in range(4)]
        chosen = send(producer, worker, kwargs={"prompt": "Pick", "sampling": {"choice": ["left", "right"]}})
        bad = send(producer, worker, kwargs={"prompt": "x", "sampling": {"regex": "(oops"}})
        results = [r.get(timeout=60) for r in sent]
        assert chosen.get(timeout=60)["text"] in ("left", "right")
        with pytest.raises(Exception, match=re.escape("regex must be a regular expression")) as failed:
            bad.get(timeout=30)
        assert "unclosed group" in str(failed.value)
    for res in results:
        assert res["status"] == "succeeded" and res["finish_reason"] == "stop"
        jsonschema.validate(json.loads(res["text"]), schema)


def test_revoke_ends_a_queued_task_unrun_and_aborts_a_running_one_freeing_its_kv_blocks(url, producer):
    engine = tiny_engine(max_num_seqs=1)  # one running sequence: the next tasks wait for it
    blocks = engine.block_manager.num_blocks
    with celery_worker(url, producer, engine) as worker:
        running = send(producer, worker, kwargs={"prompt_token_ids": [1, 2, 3], "sampling": LONG})
        wait_for(lambda: running.state == "STARTED", 30, "the first task to start")
        held = send(producer, worker, kwargs={"prompt": "waits in the worker", "sampling": GREEDY})
        queued = send(producer, worker, kwargs={"prompt": "waits in the queue", "sampling": GREEDY})
        expiring = send(producer, worker, kwargs={"prompt": "too late", "sampling": GREEDY}, expires=0.5)
        time.sleep(0.6)
        for r in (queued, held, running):
            r.revoke()
        for r, reason in ((running, "cancelled while running"), (held, "revoked before it started"),
                          (queued, "revoked before it started"), (expiring, "before it started")):
            with pytest.raises(TaskRevokedError, match=reason):
                r.get(timeout=30)
            assert r.state == "REVOKED"
        assert send(producer, worker, kwargs={"prompt": "after", "sampling": GREEDY}).get(timeout=30)["status"] \
            == "succeeded"
        assert engine.block_manager.num_free_blocks == blocks
        assert "expired at" in str(AsyncResult(expiring.id, app=producer).result)


def test_a_pickled_message_is_refused_without_being_unpickled(url, producer, engine, tmp_path):
    tripwire = tmp_path / "unpickled"

    class Tripwire:  # unpickling it creates the file
        def __reduce__(self):
            return open, (str(tripwire), "w")

    with celery_worker(url, producer, engine) as worker:
        r = send(producer, worker, kwargs={"prompt": Tripwire()}, serializer="pickle")
        with pytest.raises(Exception, match="content type 'application/x-python-serialize'.*JSON only"):
            r.get(timeout=30)
        assert r.state == "FAILURE"
        assert send(producer, worker, kwargs={"prompt": "next", "sampling": GREEDY}).get(timeout=30)["status"] \
            == "succeeded"
    assert not tripwire.exists()


def test_200_celery_tasks_and_200_queue_jobs_on_one_worker_all_complete(url, producer, engine, reference):
    from monitoring.metrics import Metrics

    sampling = {"temperature": 0.0, "max_tokens": 4, "ignore_eos": True}
    prompts = [[(i * 13 + k) % 400 + 3 for k in range(2 + i % 6)] for i in range(200)]
    metrics = Metrics(queue="q", model="tiny")
    with celery_worker(url, producer, engine, metrics) as worker:
        client = Client(url, worker.settings.queue)
        ids = client.submit_many([{"prompt": f"ticket {i}", "sampling": sampling} for i in range(200)])
        sent = [send(producer, worker, kwargs={"prompt_token_ids": ids_, "sampling": sampling}) for ids_ in prompts]
        celery_results = [r.get(timeout=120) for r in sent]
        native_results = [client.result(i, timeout=120) for i in ids]
        celery_queue = worker.settings.celery_queue
        wait_for(lambda: not client.redis.hlen(unacked_key(celery_queue)), 10, "every Celery message acked")
    expected = reference.generate(prompts, SamplingParams(**sampling), use_tqdm=False)
    assert [r["token_ids"] for r in celery_results] == [e.token_ids for e in expected]
    assert all(r.ok and len(r.token_ids) == 4 for r in native_results)
    assert client.redis.llen(celery_queue) == 0
    labels = {"queue": "q", "model_name": "tiny", "status": "succeeded"}
    assert metrics.registry.get_sample_value("redline_jobs_completed_total", {**labels, "source": "celery"}) == 200
    assert metrics.registry.get_sample_value("redline_jobs_completed_total", {**labels, "source": "redline"}) == 200


def test_a_draining_worker_puts_a_running_task_back_for_the_next_worker(url, producer, engine, reference):
    queue = new_queue()
    sampling = {**LONG, "max_tokens": 300}
    r = producer.send_task(TASK_NAME, kwargs={"prompt_token_ids": [4, 5, 6], "sampling": sampling}, queue=queue)
    redis = Client(url, queue).redis
    with worker_thread(url, new_queue(), engine, celery_queue=queue, drain_timeout=0):
        wait_for(lambda: r.state == "STARTED", 30, "the task to start")
    assert redis.llen(queue) == 1 and not redis.hlen(unacked_key(queue))  # back on the queue, unfinished
    with worker_thread(url, new_queue(), engine, celery_queue=queue):
        result = r.get(timeout=60)
    expected = reference.generate([[4, 5, 6]], SamplingParams(**sampling), use_tqdm=False)[0]
    assert result["token_ids"] == expected.token_ids


def test_message_priorities_map_to_redline_levels_as_kombu_serves_them():
    # kombu's Redis transport serves priority 0 first and 9 last; unset is redline's default level
    assert [priority_level(p) for p in (None, 0, 2, 3, 5, 6, 9)] == [0, 2, 2, 1, 1, 0, 0]


@pytest.mark.timeout(180)
def test_kill_9_mid_task_another_worker_runs_it_after_the_visibility_timeout(url, producer, reference):
    queue = new_queue()
    args = ("--celery-queue", queue, "--celery-visibility-timeout", "2")
    sampling = {**LONG, "max_tokens": 300}
    victim = start_worker_process(url, new_queue(), "a", *args)
    heir = None
    try:
        r = producer.send_task(TASK_NAME, kwargs={"prompt_token_ids": [7, 8, 9], "sampling": sampling}, queue=queue)
        wait_for(lambda: r.state == "STARTED", 60, "worker a to start the task", every=0.02)
        victim.send_signal(signal.SIGKILL)
        victim.wait()
        heir = start_worker_process(url, new_queue(), "b", *args)
        result = r.get(timeout=90)
        assert result["worker"] == "b" and result["attempts"] == 2, log_of(heir)
        expected = reference.generate([[7, 8, 9]], SamplingParams(**sampling), use_tqdm=False)[0]
        assert result["token_ids"] == expected.token_ids
        redis = Client(url, queue).redis
        wait_for(lambda: not redis.hlen(unacked_key(queue)), 10, "the message acked")
        assert redis.llen(queue) == 0
        assert stop_process(heir) == 0, log_of(heir)
    finally:
        for proc in (victim, heir):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()


def run_redline(*args: str) -> subprocess.CompletedProcess:
    env = {"OMP_NUM_THREADS": "1", **os.environ, "PYTHONPATH": str(REPO_ROOT)}
    for name in ("REDIS_URL", "REDLINE_REDIS_URL", "REDLINE_DEBUG"):
        env.pop(name, None)
    return subprocess.run([sys.executable, "-m", "worker.cli", *args], cwd=REPO_ROOT, env=env, capture_output=True,
                          text=True, timeout=300)


def test_bench_through_queue_with_celery_compares_celery_tasks_on_cpu():
    done = run_redline("bench", "--through-queue", "--celery", "--model", "tiny", "--num-seqs", "8", "--device", "cpu",
                       "--min-input-len", "5", "--max-input-len", "40", "--min-output-len", "4", "--max-output-len",
                       "24", "--max-token-id", "500", "--max-model-len", "128", "--submit-jobs", "100")
    assert done.returncode == 0, done.stderr[-3000:]
    record = json.loads(done.stdout.strip().splitlines()[-1])
    assert record["celery_tokens"] == record["queue_tokens"] == record["raw_tokens"] > 0
    assert record["celery_seconds"] > 0 and record["celery_vs_raw"] > 0
    assert "through Celery:" in done.stdout


def test_a_celery_queue_on_a_redis_cluster_is_a_one_line_mistake():
    done = run_redline("worker", "--model", "tiny", "--redis-url", "redis+cluster://127.0.0.1:7000",
                       "--celery-queue", "jobs")
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2 and len(lines) == 1 and "does not support Redis Cluster" in lines[0], done.stderr
