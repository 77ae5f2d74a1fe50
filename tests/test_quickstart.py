"""The first hour on a fresh machine: the README's two-terminal quickstart with no Redis URL anywhere,
the built-in model by name (`tiny`, the shipped benchmark shapes), and `redline bench` without a GPU."""
from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from engine.builtin import SHIPPED_CONFIGS, TINY_MODEL_DIR
from producer.embedded import port_is_free
from queue_helpers import REPO_ROOT, stop_process, wait_for

DEFAULT_PORT = 6379


def fresh_env(runtime_dir: Path) -> dict:
    """This machine's environment with no Redis URL in it, and its own runtime folder (where a worker
    publishes its embedded Redis) and data folder (where that Redis keeps its data), so that parallel
    runs never see each other's."""
    env = {"OMP_NUM_THREADS": "1", **os.environ, "PYTHONPATH": str(REPO_ROOT), "XDG_RUNTIME_DIR": str(runtime_dir),
           "XDG_DATA_HOME": str(runtime_dir / "data")}
    for name in ("REDIS_URL", "REDLINE_REDIS_URL", "REDLINE_DEBUG", "REDLINE_MODEL", "REDLINE_REDIS_DATA_DIR"):
        env.pop(name, None)
    return env


def redline(*args: str, env: dict, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "worker.cli", *args], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def listening_holder(port: int) -> socket.socket:
    """A socket that listens on the port and never answers (as a foreign service would). It binds as
    redis-server and `port_is_free` do (SO_REUSEADDR), so a port `port_is_free` calls free it can hold."""
    holder = socket.socket()
    holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    holder.bind(("127.0.0.1", port))
    holder.listen()
    return holder


@pytest.fixture
def default_port_taken():
    """Port 6379 held by a socket that listens and never answers."""
    if not port_is_free(DEFAULT_PORT):
        yield  # something here holds it already
        return
    with listening_holder(DEFAULT_PORT):
        yield


def test_a_port_with_connections_in_time_wait_is_free_and_can_be_held(tmp_path):
    with listening_holder(0) as server:
        port = server.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port)) as client:
            accepted, _ = server.accept()
            accepted.close()  # the side that closes first keeps the port in TIME_WAIT
            client.recv(1)
    assert port_is_free(port)
    listening_holder(port).close()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("port", ["6379-taken", "6379-free"])
def test_two_terminal_quickstart_connects_with_no_url(port, tmp_path, request):
    if port == "6379-taken":
        request.getfixturevalue("default_port_taken")
    elif not port_is_free(DEFAULT_PORT):
        pytest.skip("port 6379 is in use on this machine")
    env = fresh_env(tmp_path)
    log = open(tmp_path / "worker.log", "w+")
    worker = subprocess.Popen([sys.executable, "-m", "worker.cli", "worker", "--model", "tiny"], cwd=REPO_ROOT,
                              env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
    published = tmp_path / "redline"
    try:
        wait_for(lambda: list(published.glob("redis-*.url")) or worker.poll() is not None, 60,
                 "the worker to publish its embedded redis-server")
        done = redline("submit", "Hello", "--stream", "--max-tokens", "8", "--timeout", "120", env=env)
        assert done.returncode == 0, done.stderr + (tmp_path / "worker.log").read_text()
        assert done.stdout.endswith("\n") and len(done.stdout) > 1
    finally:
        code = stop_process(worker)
        log.close()
    out = (tmp_path / "worker.log").read_text()
    assert code == 0, out
    assert "`redline submit` on this machine finds it" in out and "RANDOM weights" in out
    assert f"data in {tmp_path / 'data' / 'redline' / 'redis'}" in out  # the user's XDG data folder
    assert list(published.glob("redis-*.url")) == []  # removed on exit


def test_a_published_url_of_a_dead_worker_is_ignored(tmp_path):
    from producer.client import LOCAL_URL, default_url

    folder = tmp_path / "redline"
    folder.mkdir(mode=0o700)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (folder / f"redis-{dead.pid}.url").write_text("redis://127.0.0.1:1/0\n")
    (folder / f"redis-{os.getpid()}.url").write_text("redis://127.0.0.1:2/0\n")
    env = {"XDG_RUNTIME_DIR": str(tmp_path)}
    with pytest.MonkeyPatch.context() as mp:
        for name, value in env.items():
            mp.setenv(name, value)
        mp.delenv("REDIS_URL", raising=False)
        mp.delenv("REDLINE_REDIS_URL", raising=False)
        assert default_url() == "redis://127.0.0.1:2/0"
        assert not (folder / f"redis-{dead.pid}.url").exists()
        (folder / f"redis-{os.getpid()}.url").unlink()
        assert default_url() == LOCAL_URL
        mp.setenv("REDIS_URL", "redis://elsewhere:6379/0")
        assert default_url() == "redis://elsewhere:6379/0"


def test_llm_tiny_is_the_built_in_random_model(caplog):
    from engine import LLM

    with caplog.at_level(logging.WARNING, logger="redline.engine"):
        llm = LLM("tiny", device="cpu")
    try:
        assert llm.config.model_dir == TINY_MODEL_DIR and llm.config.load_format == "dummy"
        assert [r.getMessage() for r in caplog.records].count(
            "model 'tiny' is the built-in tiny model with RANDOM weights: its completions are gibberish") == 1
        [out] = llm.generate(["Hello"], {"max_tokens": 4, "ignore_eos": True}, use_tqdm=False)
        assert len(out.token_ids) == 4
    finally:
        llm.shutdown()


def test_built_in_names_resolve_and_a_local_directory_of_that_name_wins(tmp_path, monkeypatch):
    from engine.config import resolve_model_dir

    assert resolve_model_dir("tiny", "auto") == TINY_MODEL_DIR
    assert resolve_model_dir("qwen3-0.6b", "dummy") == SHIPPED_CONFIGS["qwen3-0.6b"]
    with pytest.raises(ValueError, match="--load-format dummy"):
        resolve_model_dir("qwen3-8b", "auto")
    shutil.copytree(TINY_MODEL_DIR, tmp_path / "tiny")
    monkeypatch.chdir(tmp_path)
    assert resolve_model_dir("tiny", "auto") == "tiny"


@pytest.mark.timeout(180)
def test_demo_runs_with_model_tiny(tmp_path):
    done = redline("demo", "--model", "tiny", "--num-jobs", "2", "--max-tokens", "4", env=fresh_env(tmp_path))
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("[succeeded]") == 2 and "RANDOM weights" in done.stderr
    assert "the demo's embedded Redis is ephemeral" in done.stdout


@pytest.mark.timeout(180)
def test_bench_runs_with_model_tiny(tmp_path):
    done = redline("bench", "--model", "tiny", "--num-seqs", "2", "--min-input-len", "4", "--max-input-len", "16",
                   "--min-output-len", "2", "--max-output-len", "4", env=fresh_env(tmp_path))
    assert done.returncode == 0, done.stderr
    record = json.loads(done.stdout.strip().splitlines()[-1])
    assert record["model"] == "tiny-qwen3" and 4 <= record["tokens"] <= 8


def one_line(done: subprocess.CompletedProcess) -> str:
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in done.stderr and done.returncode == 2, done.stderr
    return lines[0]


def test_bench_without_cuda_suggests_model_tiny_at_once(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    start = time.monotonic()
    done = redline("bench", env=fresh_env(tmp_path))
    assert "--model tiny" in one_line(done) and "no CUDA" in one_line(done)
    assert time.monotonic() - start < 60  # said before any model loads


@pytest.mark.parametrize("args, words", [
    (["--max-output-len", "64"], "--min-output-len (100) is more than --max-output-len (64)"),
    (["--max-input-len", "50"], "--min-input-len (100) is more than --max-input-len (50)"),
    (["--num-seqs", "0"], "--num-seqs must be at least 1"),
    (["--min-output-len", "0"], "--min-output-len must be at least 1"),
    (["--through-queue", "--submit-jobs", "-1"], "--submit-jobs must be at least 1"),
    (["--celery"], "--celery compares Celery tasks with the queue's jobs: add --through-queue"),
    (["--cache-aware-admission"], "--cache-aware-admission applies to the queue's run: add --through-queue"),
    (["--shared-prefixes", "--through-queue"], "--shared-prefixes runs its own jobs through the queue"),
])
def test_bench_workload_mistake_is_one_line(args, words, tmp_path):
    done = redline("bench", "--model", "tiny", *args, env=fresh_env(tmp_path))
    assert words in one_line(done)
