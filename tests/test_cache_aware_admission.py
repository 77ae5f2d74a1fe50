"""Cache-aware admission through the queue (`--cache-aware-admission`), on real redis-servers and the tiny model:
with a small KV cache and interleaved jobs of a few shared prefixes, the prompt tokens computed fall to the ideal
(each prefix once) where arrival order computes them again and again, with the same greedy tokens; the age
bound, priorities and deadlines hold; jobs read ahead stay the worker's pending entries (reclaimed by another
worker when it is killed, cancellable, handed back on SIGTERM)."""
from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time

import pytest
import redis

from producer import Client
from producer import protocol as p
from queue_helpers import (REPO_ROOT, log_of, new_queue, one_torch_thread, start_worker_process, stop_process,
                           tiny_engine, wait_for, worker_thread)
from queue_helpers import url  # noqa: F401 - the fixture: a module's Redis, on each server

BLOCK = 16
PREFIX = 6 * BLOCK
GREEDY = {"temperature": 0.0, "ignore_eos": True}


def _family_jobs(tag: str, num_prefixes: int, per_prefix: int, max_tokens: int = 4, seed: int = 0) -> list[dict]:
    """Jobs of `num_prefixes` shared prefixes of PREFIX tokens, interleaved (A B C D A B C D ...)."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, 400) for _ in range(PREFIX)] for _ in range(num_prefixes)]
    jobs = []
    for i in range(per_prefix):
        for f, prefix in enumerate(prefixes):
            suffix = [rng.randrange(3, 400) for _ in range(3 + (i * 5 + f) % 11)]
            jobs.append({"job_id": f"{tag}-{f}-{i}", "prompt_token_ids": prefix + suffix,
                         "sampling": {**GREEDY, "max_tokens": max_tokens}})
    return jobs


def _engine(cache_aware: bool, **kwargs):
    options = dict(kvcache_block_size=BLOCK, num_kvcache_blocks=24, max_num_seqs=2, max_model_len=256,
                   prefer_cached_prefixes=cache_aware)
    return tiny_engine(**{**options, **kwargs})


def _started_ms(client: Client, job_id: str) -> int:
    return int(client.redis.hget(client.keys.job(job_id), "started_ms"))


def _run(url: str, jobs: list[dict], cache_aware: bool, **settings):
    """Submit every job, then serve them with one worker; (results in job order, prompt tokens computed)."""
    client = Client(url, new_queue())
    client.submit_many(jobs)
    with one_torch_thread():
        engine = _engine(cache_aware)
        with worker_thread(url, client.keys.queue, engine, cache_aware_admission=cache_aware, lookahead=64,
                           **settings):
            results = [client.result(job["job_id"], timeout=120) for job in jobs]
    bm = engine.block_manager
    return client, results, bm.num_cache_queries - bm.num_cache_hits


def test_interleaved_shared_prefixes_are_computed_once_each_with_the_same_tokens(url):
    jobs = _family_jobs("fam", num_prefixes=4, per_prefix=6)
    ideal = sum(len(j["prompt_token_ids"]) - PREFIX for j in jobs) + 4 * PREFIX
    _, arrival, arrival_computed = _run(url, jobs, cache_aware=False)
    _, aware, aware_computed = _run(url, jobs, cache_aware=True)
    assert all(r.status == p.SUCCEEDED for r in arrival + aware)
    assert [r.token_ids for r in aware] == [r.token_ids for r in arrival]
    assert aware_computed <= 1.1 * ideal, (aware_computed, ideal)
    print(f"prompt tokens computed: ideal {ideal}, cache-aware {aware_computed}, arrival order {arrival_computed}")
    assert arrival_computed >= 1.8 * ideal, (arrival_computed, ideal)


def _sibling_order(client: Client, jobs: list[dict]) -> list[str]:
    return sorted((j["job_id"] for j in jobs), key=lambda job_id: _started_ms(client, job_id))


@pytest.mark.parametrize("max_wait", [0.15, 60.0])
def test_a_job_of_its_own_prefix_waits_at_most_the_age_bound(url, max_wait):
    siblings = _family_jobs("sib", num_prefixes=1, per_prefix=40, max_tokens=24)
    lone = _family_jobs("lone", num_prefixes=1, per_prefix=1, max_tokens=24, seed=1)[0]
    jobs = [siblings[0], lone, *siblings[1:]]  # the lone job is second in line
    client, results, _ = _run(url, jobs, cache_aware=True, admission_max_wait=max_wait)
    assert all(r.status == p.SUCCEEDED for r in results)
    order = _sibling_order(client, jobs)
    if max_wait < 1:
        # it starts once it has waited max_wait, with siblings still to run after it
        assert order.index(lone["job_id"]) < len(order) - 10, order
    else:  # the bound is what lets it in: grouping alone keeps it for last (started with the last sibling or after)
        assert _started_ms(client, lone["job_id"]) >= max(_started_ms(client, j["job_id"]) for j in siblings)


def test_a_higher_priority_and_a_near_deadline_go_before_cached_siblings(url):
    client = Client(url, new_queue())
    siblings = _family_jobs("sib", num_prefixes=1, per_prefix=24, max_tokens=24)
    client.submit_many(siblings)
    urgent = _family_jobs("urgent", num_prefixes=2, per_prefix=1, max_tokens=4, seed=2)
    with one_torch_thread():
        with worker_thread(url, client.keys.queue, _engine(True), cache_aware_admission=True, lookahead=64):
            wait_for(lambda: client.redis.xlen(client.keys.results) >= 2, 60, "the first results")
            seconds, micros = client.redis.time()
            submitted_ms = seconds * 1000 + micros // 1000
            client.submit(job_id=urgent[0]["job_id"], prompt_token_ids=urgent[0]["prompt_token_ids"],
                          sampling=urgent[0]["sampling"], priority=2)
            client.submit(job_id=urgent[1]["job_id"], prompt_token_ids=urgent[1]["prompt_token_ids"],
                          sampling=urgent[1]["sampling"], deadline_s=20)  # within the age bound
            results = [client.result(j["job_id"], timeout=120) for j in siblings + urgent]
    assert all(r.status == p.SUCCEEDED for r in results)
    sibling_starts = [_started_ms(client, s["job_id"]) for s in siblings]
    for job in urgent:
        started = _started_ms(client, job["job_id"])
        # the cached siblings did not go first: at most the slots that freed while it was read passed it
        assert sum(submitted_ms <= t < started for t in sibling_starts) <= 2
        assert sum(t > started for t in sibling_starts) >= 10


def _long_jobs(n: int) -> list[dict]:
    return [{"job_id": f"long-{i}", "prompt_token_ids": [5 + i, 6, 7], "sampling": {**GREEDY, "max_tokens": 240}}
            for i in range(n)]


def test_a_job_read_ahead_expires_on_its_deadline_and_is_cancellable_while_the_engine_is_full(url):
    client = Client(url, new_queue())
    client.submit_many(_long_jobs(3))
    with one_torch_thread():
        with worker_thread(url, client.keys.queue, _engine(True, max_num_seqs=1), cache_aware_admission=True,
                           claim_timeout=1.0):
            wait_for(lambda: _status(client, "long-0") == p.RUNNING, 30, "the first long job to run")
            doomed = client.submit(prompt_token_ids=[9, 9, 9], sampling=GREEDY, deadline_s=0.1)
            other = client.submit(prompt_token_ids=[8, 8, 8], sampling=GREEDY)
            # read ahead, not started: still queued, pending under the worker
            wait_for(lambda: _read_ahead(client, other), 10, "the job read ahead")
            assert client.cancel(other)
            assert client.result(other, timeout=5).status == p.CANCELLED
            expired = client.result(doomed, timeout=5)
            assert expired.status == p.EXPIRED and "deadline" in expired.error
            results = [client.result(j["job_id"], timeout=120) for j in _long_jobs(3)]
    assert all(r.status == p.SUCCEEDED for r in results)
    assert client.result(other, timeout=1).status == p.CANCELLED  # never run afterwards
    assert _pending(client) == 0


def _status(client: Client, job_id: str) -> str | None:
    status = client.redis.hget(client.keys.job(job_id), "status")
    return None if status is None else status.decode()


def _read_ahead(client: Client, job_id: str) -> bool:
    """Whether the job is pending under a worker and not started."""
    entry = client.redis.hget(client.keys.job(job_id), "entry")
    pending = client.redis.xpending_range(client.keys.jobs(0), p.GROUP, entry, entry, 1) if entry else []
    return bool(pending) and _status(client, job_id) == p.QUEUED


def _pending(client: Client, consumer: str | None = None) -> int:
    try:
        summary = client.redis.xpending(client.keys.jobs(0), p.GROUP)
    except redis.ResponseError:  # no worker has made the group yet
        return 0
    return sum(c["pending"] for c in summary["consumers"] if consumer is None or c["name"].decode() == consumer)


def test_jobs_read_ahead_by_a_live_worker_are_not_taken_over_past_the_claim_timeout(url):
    client = Client(url, new_queue())
    jobs = _long_jobs(6)
    client.submit_many(jobs)
    with one_torch_thread():
        busy, idle = _engine(True, max_num_seqs=1), _engine(False)
        with worker_thread(url, client.keys.queue, busy, cache_aware_admission=True, lookahead=8, claim_timeout=0.5,
                           worker_name="reads-ahead"):
            wait_for(lambda: _pending(client, "reads-ahead") >= 5, 10, "the jobs read ahead")
            with worker_thread(url, client.keys.queue, idle, claim_timeout=0.5, worker_name="idle"):
                results = [client.result(j["job_id"], timeout=120) for j in jobs]
    assert all(r.status == p.SUCCEEDED for r in results)
    # the heartbeat kept what waited many claim timeouts in the read-ahead: the other worker took none
    assert {client.redis.hget(client.keys.job(j["job_id"]), "worker").decode() for j in jobs} == {"reads-ahead"}


@pytest.mark.timeout(300)
def test_jobs_read_ahead_are_reclaimed_after_kill_9_and_handed_back_on_sigterm(url):
    client = Client(url, new_queue())
    q = client.keys.queue
    jobs = _family_jobs("proc", num_prefixes=2, per_prefix=6, max_tokens=64)
    client.submit_many(jobs)
    args = ("--cache-aware-admission", "--lookahead", "16", "--max-num-seqs", "1", "--claim-timeout", "2",
            "--max-model-len", "256", "--kvcache-block-size", str(BLOCK))
    first = start_worker_process(url, q, "ahead-a", *args)
    try:
        # more entries pending under it than its one sequence slot: read ahead, still queued
        wait_for(lambda: _pending(client, "ahead-a") >= 8, 60, "worker a reading ahead")
        assert sum(_status(client, j["job_id"]) == p.QUEUED for j in jobs) >= 6
        first.send_signal(signal.SIGKILL)
        first.wait()
        second = start_worker_process(url, q, "ahead-b", *args)
        # b reclaims a's entries once idle past the claim timeout, and reads ahead again
        wait_for(lambda: _pending(client, "ahead-a") == 0 and _pending(client, "ahead-b") >= 4, 90,
                 "worker b taking over a's entries")
        assert stop_process(second) == 0, log_of(second)
        assert _pending(client) == 0  # what b read ahead went back to the stream
        finished = sum(client.redis.exists(client.keys.done(j["job_id"])) for j in jobs)
        assert finished < len(jobs)
        third = start_worker_process(url, q, "ahead-c", *args)
        results = [client.result(j["job_id"], timeout=120) for j in jobs]
        assert stop_process(third) == 0, log_of(third)
    finally:
        for proc in (first,):
            if proc.poll() is None:
                proc.kill()
    assert all(r.status == p.SUCCEEDED for r in results)
    assert len({r.job_id for r in results}) == len(jobs)


# ---- the choice alone (worker/admission.py) ----

def _lookahead(max_wait: float = 30.0, cached=lambda hashes: 0):
    from worker.admission import Lookahead
    return Lookahead(capacity=16, max_wait=max_wait, cached_blocks=cached)


def _job(job_id: str, priority: int = 0, deadline_s: float | None = None, enqueued_ms: int | None = None):
    from worker.consumer import Job
    entry_id = f"{enqueued_ms if enqueued_ms is not None else int(time.time() * 1000)}-0"
    spec = p.JobSpec(prompt_token_ids=[1], priority=priority, deadline_s=deadline_s)
    return Job(job_id, "stream", entry_id, spec)


def _ids(waiting) -> list[str]:
    return [w.job.job_id for w in waiting]


def test_choice_groups_siblings_of_a_cached_prefix_after_priority():
    ahead = _lookahead(cached=lambda hashes: 2 if hashes[0] == 20 else 0)
    for job_id, hashes in (("a1", [10, 11]), ("b1", [20, 21]), ("a2", [10, 11]), ("c1", [30]), ("b2", [20, 21]),
                           ("a3", [10, 12])):
        ahead.add(_job(job_id), hashes)
    ahead.add(_job("high", priority=2), [40])
    # priority first; then what the cache holds (b); then the oldest (a1) and its siblings, whose blocks it computes
    assert _ids(ahead.choose(5)) == ["high", "b1", "b2", "a1", "a2"]
    assert _ids(ahead.choose(5)) == ["a3", "c1"]


def test_choice_puts_a_near_deadline_or_an_aged_job_first_and_starts_an_expired_one_at_once():
    ahead = _lookahead(max_wait=0.2, cached=lambda hashes: len(hashes))
    ahead.add(_job("cached"), [1, 2, 3])
    ahead.add(_job("soon", deadline_s=5.0), [])  # within max_wait? no: 5 s > 0.2 s
    ahead.add(_job("near", deadline_s=0.15), [])
    ahead.add(_job("gone", deadline_s=1.0, enqueued_ms=int(time.time() * 1000) - 2000), [])
    due, lost = ahead.due()
    assert _ids(due) == ["gone"] and lost == []
    assert _ids(ahead.choose(1)) == ["near"]
    assert _ids(ahead.choose(1)) == ["cached"]
    time.sleep(0.25)  # "soon" has waited max_wait: it goes before a newer cached one
    ahead.add(_job("cached2"), [1, 2, 3])
    assert _ids(ahead.choose(1)) == ["soon"]


def test_jobs_taken_over_or_cancelled_while_read_ahead_leave_it():
    ahead = _lookahead()
    jobs = [_job(f"j{i}") for i in range(3)]
    for job in jobs:
        ahead.add(job, [])
    jobs[0].abort_reason, jobs[1].abort_reason = "lost", "cancel"
    due, lost = ahead.due()
    assert _ids(due) == ["j1"] and lost == [jobs[0]]
    ahead.restore(due)  # starting them failed: they wait again
    assert len(ahead) == 2 and ahead.space() == 14
    assert sorted(j.job_id for j in ahead.take_all()) == ["j1", "j2"]


def test_the_age_bound_counts_from_a_jobs_turn_in_arrival_order_not_from_its_read():
    ahead = _lookahead(max_wait=0.1)
    ahead.add(_job("a0"), [1, 2])
    ahead.add(_job("lone"), [9])
    for i in range(1, 8):
        ahead.add(_job(f"a{i}"), [1, 2])
    assert _ids(ahead.choose(2)) == ["a0", "a1"]  # two starts: a0's turn and the lone job's have come
    time.sleep(0.15)  # everything was read over max_wait ago, but only the lone job is past its turn
    assert _ids(ahead.choose(3)) == ["lone", "a2", "a3"]


def test_text_and_chat_jobs_are_tokenized_once_ahead_and_give_the_same_tokens(url):
    system = "You answer questions about the history of container shipping in one short sentence. " * 3
    jobs = []
    for i in range(6):
        jobs.append({"job_id": f"text-{i}", "prompt": system + f"Question {i}: when did it start?",
                     "sampling": {**GREEDY, "max_tokens": 6}})
        jobs.append({"job_id": f"chat-{i}", "messages": [{"role": "system", "content": system},
                                                         {"role": "user", "content": f"Question {i}?"}],
                     "sampling": {**GREEDY, "max_tokens": 6}})
    _, arrival, _ = _run(url, jobs, cache_aware=False)
    _, aware, aware_computed = _run(url, jobs, cache_aware=True)
    assert all(r.status == p.SUCCEEDED for r in arrival + aware)
    assert [r.token_ids for r in aware] == [r.token_ids for r in arrival]
    assert [r.usage.prompt_tokens for r in aware] == [r.usage.prompt_tokens for r in arrival]
    assert aware_computed < sum(r.usage.prompt_tokens for r in aware) / 2  # the shared system text, cached


def test_lookahead_without_cache_aware_admission_is_one_line_and_exit_2():
    done = subprocess.run([sys.executable, "-m", "worker.cli", "worker", "--model", "tiny", "--lookahead", "8"],
                          cwd=REPO_ROOT, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)}, capture_output=True,
                          text=True, timeout=120)
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert "--cache-aware-admission" in lines[0] and "Traceback" not in done.stderr


def test_every_job_read_ahead_leaves_it_exactly_once_and_never_before_a_higher_priority():
    rng = random.Random(7)
    cache: set[int] = set()
    ahead = _lookahead(max_wait=0.002, cached=lambda hashes: next((i for i, h in enumerate(hashes)
                                                                      if h not in cache), len(hashes)))
    jobs, out = {}, []
    for step in range(1500):
        action = rng.random()
        if action < 0.45 and ahead.space():
            family = rng.randrange(6)
            job = _job(f"j{step}", priority=rng.choice(p.PRIORITIES),
                       deadline_s=rng.choice([None, None, None, 0.001, 30.0]))
            jobs[job.job_id] = job
            ahead.add(job, [family * 10 + k for k in range(rng.randrange(0, 4))])
        elif action < 0.8:
            waiting = {j.job_id: j.spec.priority for j in jobs.values() if j.job_id not in out}
            chosen = ahead.choose(rng.randrange(1, 4))
            for w in chosen:  # each the highest priority still waiting when it was taken
                assert w.priority == max(waiting.values()), (w.priority, waiting)
                del waiting[w.job.job_id]
            out += [w.job.job_id for w in chosen]
            if rng.random() < 0.1:  # starting them failed: they wait again
                ahead.restore(chosen)
                del out[len(out) - len(chosen):]
        elif action < 0.9:
            waiting = [j for j in jobs.values() if j.job_id not in out]
            if waiting:
                rng.choice(waiting).abort_reason = rng.choice(["cancel", "lost"])
            due, lost = ahead.due()
            out += [w.job.job_id for w in due] + [job.job_id for job in lost]
        else:
            cache.add(rng.randrange(60))
        assert len(ahead) == len(jobs) - len(out)
    out += [job.job_id for job in ahead.take_all()]
    assert sorted(out) == sorted(jobs) and len(set(out)) == len(out)
