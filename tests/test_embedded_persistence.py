"""A worker started with no Redis URL keeps its embedded redis-server's data in a data directory: a restart
finds every queued job and every result again, and a second worker never shares the directory."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine.builtin import TINY_MODEL_DIR
from producer import Client
from producer.embedded import RedisServer
from queue_helpers import REPO_ROOT, stop_process, wait_for
from test_quickstart import fresh_env

FINAL = ("succeeded", "failed", "cancelled", "expired")


def start_worker(data_dir: Path, runtime_dir: Path, log_path: Path) -> tuple[subprocess.Popen, str]:
    """`redline worker` with no URL, one sequence at a time; returns it and the URL it published."""
    for old in (runtime_dir / "redline").glob("redis-*.url"):
        old.unlink()
    cmd = [sys.executable, "-m", "worker.cli", "worker", "--model", TINY_MODEL_DIR, "--load-format", "dummy",
           "--device", "cpu", "--max-num-seqs", "1", "--drain-timeout", "0", "--redis-data-dir", str(data_dir)]
    worker = subprocess.Popen(cmd, cwd=REPO_ROOT, env=fresh_env(runtime_dir), stdout=open(log_path, "a"),
                              stderr=subprocess.STDOUT, text=True)
    published = wait_for(lambda: list((runtime_dir / "redline").glob("redis-*.url")) or worker.poll() is not None,
                         120, "the worker to publish its embedded redis-server")
    assert worker.poll() is None, log_path.read_text()
    return worker, published[0].read_text().strip()


@pytest.mark.timeout(300)
def test_queued_jobs_and_results_survive_a_worker_restart(tmp_path):
    data_dir, log_path = tmp_path / "data", tmp_path / "worker.log"
    worker, url = start_worker(data_dir, tmp_path, log_path)
    try:
        with Client(url) as client:
            finished = client.submit("Hello", sampling={"max_tokens": 4, "temperature": 0})
            before = client.result(finished, timeout=120)
            assert before.status == "succeeded", log_path.read_text()
            # one job runs at a time and each of these takes many steps: most wait in the queue at SIGTERM
            long = {"max_tokens": 300, "ignore_eos": True, "temperature": 0}
            pending = [client.submit(f"story {i}", sampling=long) for i in range(3)]
            unfinished = [j for j in pending if client.status(j).status not in FINAL]
    finally:
        assert stop_process(worker) == 0, log_path.read_text()
    assert unfinished, "every job finished before SIGTERM: nothing was left queued"
    assert f"data in {data_dir}" in log_path.read_text()

    worker, url = start_worker(data_dir, tmp_path, log_path)
    try:
        with Client(url) as client:
            assert client.result(finished, timeout=10).text == before.text
            for job_id in pending:
                res = client.result(job_id, timeout=240)
                assert res.status == "succeeded" and len(res.token_ids) == 300, res
    finally:
        assert stop_process(worker) == 0, log_path.read_text()


def test_a_second_worker_on_a_data_dir_in_use_says_so_in_one_line(tmp_path):
    data_dir = tmp_path / "data"
    with RedisServer(data_dir=str(data_dir)) as holder:
        cmd = [sys.executable, "-m", "worker.cli", "worker", "--model", TINY_MODEL_DIR, "--load-format", "dummy",
               "--device", "cpu", "--redis-data-dir", str(data_dir)]
        done = subprocess.run(cmd, cwd=REPO_ROOT, env=fresh_env(tmp_path), capture_output=True, text=True,
                              timeout=120)
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        assert done.returncode == 1 and len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
        assert f"{data_dir} is in use by another embedded redis-server ({holder.url}" in lines[0]
        assert "--redis-data-dir" in lines[0]
        assert holder.process.poll() is None  # the first server is untouched
    assert (data_dir / "appendonly.aof").exists()


def test_the_lock_outlives_a_server_whose_starter_died_until_the_server_exits(tmp_path):
    data_dir = tmp_path / "data"
    server = RedisServer(data_dir=str(data_dir)).start()
    os.close(server.lock_fd)  # as if its starter were gone: the running server still holds the directory
    server.lock_fd = None
    with pytest.raises(RuntimeError, match="in use"):
        RedisServer(data_dir=str(data_dir)).start()
    server.stop()
    with RedisServer(data_dir=str(data_dir)):
        pass


def test_the_data_dir_defaults_to_the_users_xdg_data_folder(tmp_path, monkeypatch):
    from worker.settings import WorkerSettings

    monkeypatch.delenv("REDLINE_REDIS_DATA_DIR", raising=False)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    assert WorkerSettings().redis_data_dir == str(tmp_path / "redline" / "redis")
    monkeypatch.setenv("REDLINE_REDIS_DATA_DIR", "/srv/redline")
    assert WorkerSettings().redis_data_dir == "/srv/redline"
