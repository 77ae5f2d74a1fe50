"""Workers as separate processes: kill -9 mid-run loses nothing; SIGTERM drains and exits 0."""
from __future__ import annotations

import json
import shutil
import signal
from pathlib import Path

import pytest

from engine import SamplingParams
from engine.builtin import TINY_MODEL_DIR
from producer import Client
from producer import protocol as p
from queue_helpers import (log_of, new_queue, one_torch_thread, start_worker_process, stop_process, tiny_engine,
                           wait_for)
from queue_helpers import url  # noqa: F401 - the fixture: a module's Redis, on each server

NUM_JOBS = 300


def _results_written(client: Client) -> int:
    return client.redis.xlen(client.keys.results)


def _pending_of(client: Client, consumer: str) -> int:
    summary = client.redis.xpending(client.keys.jobs(0), p.GROUP)
    return sum(c["pending"] for c in summary["consumers"] if c["name"].decode() == consumer)


def _jobs() -> list[dict]:
    # greedy jobs of varied prompts and lengths; a worker runs four at a time
    return [{"job_id": f"job-{i:03d}", "prompt_token_ids": [(i * 7 + k) % 400 + 3 for k in range(3 + i % 5)],
             "sampling": {"temperature": 0.0, "max_tokens": 24 + i % 17, "ignore_eos": True}}
            for i in range(NUM_JOBS)]


@pytest.mark.timeout(300)
def test_kill_9_of_workers_mid_run_loses_and_duplicates_nothing(url):
    client = Client(url, new_queue())
    q = client.keys.queue
    args = ("--claim-timeout", "2", "--max-num-seqs", "4")
    jobs = _jobs()
    with one_torch_thread():
        reference = tiny_engine().generate([job["prompt_token_ids"] for job in jobs],
                                           [SamplingParams(**job["sampling"]) for job in jobs], use_tqdm=False)
    client.submit_many(jobs)
    names = ["a", "b"]
    workers = [start_worker_process(url, q, name, *args) for name in names]
    try:
        for victim, spare, progress in ((0, "c", NUM_JOBS // 5), (1, "d", NUM_JOBS // 2)):
            wait_for(lambda: _results_written(client) >= progress, 120, f"{progress} results")
            # mid-run: the victim holds jobs it has not finished
            wait_for(lambda: _pending_of(client, names[victim]), 30, f"worker {names[victim]} holding jobs")
            workers[victim].send_signal(signal.SIGKILL)
            workers[victim].wait()
            workers[victim] = start_worker_process(url, q, spare, *args)
            names[victim] = spare
        wait_for(lambda: _results_written(client) >= NUM_JOBS, 180, "every result")
        for proc in workers:
            assert stop_process(proc) == 0, log_of(proc)
    finally:
        for proc in workers:
            if proc.poll() is None:
                proc.kill()

    feed = [f[b"job_id"].decode() for _, f in client.redis.xrange(client.keys.results)]
    assert len(feed) == NUM_JOBS and len(set(feed)) == NUM_JOBS  # one result each, none twice
    results = [client.result(job["job_id"], timeout=1) for job in jobs]
    assert all(r.status == "succeeded" for r in results)
    assert max(r.attempts for r in results) >= 2, "the kills should have interrupted running jobs"
    assert [r.token_ids for r in results] == [o.token_ids for o in reference]
    stream = client.keys.jobs(0)
    assert client.redis.xlen(stream) == 0 and client.redis.xpending(stream, p.GROUP)["pending"] == 0


@pytest.mark.timeout(120)
def test_sigterm_lets_running_jobs_finish_then_exits_0(url):
    client = Client(url, new_queue())
    proc = start_worker_process(url, client.keys.queue, "drainer", "--max-num-seqs", "2")
    # 1,000 tokens each: the first two still run when the signal comes, even where the stream lags the engine
    ids = client.submit_many([{"prompt_token_ids": [9, 8, 7 + i], "sampling": {"max_tokens": 1000, "ignore_eos": True}}
                              for i in range(4)])
    for delta in client.stream(ids[0], timeout=60):
        if delta.index >= 5:
            break
    assert stop_process(proc, signal.SIGTERM) == 0, log_of(proc)
    statuses = [client.status(i).status for i in ids]
    # the two running jobs were finished; the two that never started are still queued for others
    assert statuses[:1] == ["succeeded"] and statuses.count("succeeded") == 2
    assert statuses.count("queued") == 2
    stream = client.keys.jobs(0)
    assert client.redis.xpending(stream, p.GROUP)["pending"] == 0 and client.redis.xlen(stream) == 2


def _long_context_tiny_model(root: Path) -> Path:
    """The tiny model with a 64k context, so that one job can run far longer than any test waits for it."""
    model = Path(shutil.copytree(TINY_MODEL_DIR, root / "tiny-64k"))
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 65536}))
    return model


@pytest.mark.timeout(120)
def test_a_second_signal_hands_running_jobs_back_at_once(url, tmp_path):
    client = Client(url, new_queue())
    # jobs of 60,000 tokens, one at a time: the first still runs when the signals come, however late its
    # status says so on a loaded machine (4,000-token jobs could finish in that lag, leaving none to hand back)
    proc = start_worker_process(url, client.keys.queue, "impatient", "--model", str(_long_context_tiny_model(tmp_path)),
                                "--max-model-len", "65536", "--max-num-seqs", "1")
    job_ids = [client.submit(prompt_token_ids=[4, 5, 6], sampling={"max_tokens": 60_000, "ignore_eos": True})
               for _ in range(6)]
    wait_for(lambda: any(getattr(client.status(j), "status", None) == "running" for j in job_ids), 60, "a job to run")
    proc.send_signal(signal.SIGTERM)
    assert stop_process(proc, signal.SIGINT) == 0, log_of(proc)
    states = [client.status(j) for j in job_ids]
    assert {s.status for s in states} == {"queued"}, states
    assert [s.attempts for s in states].count(1) == 1, states  # the one that ran
    stream = client.keys.jobs(0)
    assert client.redis.xpending(stream, p.GROUP)["pending"] == 0 and client.redis.xlen(stream) == len(job_ids)
