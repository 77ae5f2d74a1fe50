"""Structured output through the queue: constrained jobs from Client.submit run on a real worker (tiny model,
real redis-servers) and come back matching their constraints, their grammars compiled by the reader before
the engine thread sees them; a bad constraint is refused at submit, and one written past the client fails
alone at the worker."""
from __future__ import annotations

import json
import re
import threading

import jsonschema
import pytest

from producer import Client
from producer import protocol as p
from queue_helpers import new_queue, tiny_engine, worker_thread
from queue_helpers import url  # noqa: F401 - the fixture: a module's Redis, on each server

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"], "properties": {
    "name": {"type": "string", "maxLength": 8}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "items": {"enum": ["x", "y"]}, "minItems": 1, "maxItems": 3},
    "nickname": {"type": "string", "pattern": "^[a-z]{2,5}$"}}}
REGEX = r"[A-Z]{2}-[0-9]{2,4}"
CHOICE = ["approve", "reject", "escalate"]


@pytest.fixture(scope="module")
def engine():
    return tiny_engine(max_num_seqs=16, async_scheduling=True)


@pytest.fixture
def client(url):
    with Client(url, new_queue()) as c:
        yield c


def test_constrained_jobs_come_back_matching_with_grammars_compiled_by_the_reader(url, client, engine, monkeypatch):
    from engine.grammar import GrammarCache

    monkeypatch.setattr(engine, "grammars", GrammarCache(engine.tokenizer, engine.vocab_size,
                                                         engine.config.eos_token_id))  # nothing compiled yet
    compiled_on = []
    build = engine.grammars._build

    def recording_build(grammar):
        compiled_on.append(threading.current_thread().name)
        return build(grammar)

    monkeypatch.setattr(engine.grammars, "_build", recording_build)
    base = {"max_tokens": 150, "temperature": 1.0}
    jobs = {}
    with worker_thread(url, client.keys.queue, engine):
        for i in range(8):
            jobs[client.submit(f"Person {i}:", sampling={**base, "json_schema": PERSON, "seed": i})] = "json"
            jobs[client.submit(f"Code {i}:", sampling={**base, "regex": REGEX, "n": 2})] = "regex"
            jobs[client.submit(messages=[{"role": "user", "content": f"Decide {i}"}],
                               sampling={**base, "choice": CHOICE})] = "choice"
            jobs[client.submit(f"Free {i}", sampling={"max_tokens": 10})] = "free"
        jobs[client.submit("As text", sampling={**base, "json_schema": json.dumps(PERSON)})] = "json"
        results = {job_id: client.result(job_id, timeout=120) for job_id in jobs}
    for job_id, kind in jobs.items():
        res = results[job_id]
        assert res.status == "succeeded", res.error
        for c in res.outputs or [res]:
            if kind == "free":
                continue
            assert c.finish_reason == "stop", c.text
            if kind == "json":
                jsonschema.validate(json.loads(c.text), PERSON)
            elif kind == "regex":
                assert re.fullmatch(REGEX, c.text)
            else:
                assert c.text in CHOICE
    assert compiled_on and set(compiled_on) == {"redline-reader"}  # never on the engine's thread


@pytest.mark.parametrize("sampling, message", [
    ({"json_schema": {"type": "object", "properties": {"a": {"type": "wat"}}}},
     "sampling.json_schema must be a JSON schema (an object or its JSON text); got one that cannot be enforced"),
    ({"json_schema": "{nope"}, "sampling.json_schema must be a JSON schema (an object or its JSON text), got "
                               "'{nope' (not JSON"),
    ({"regex": "[a-"}, "sampling.regex must be a regular expression (Rust regex syntax); got one that cannot be "
                       "enforced"),
    ({"choice": []}, "sampling.choice must be a non-empty list of non-empty strings"),
    ({"choice": ["a"], "regex": "a"}, "give at most one of json_schema, regex, choice (got regex, choice)"),
])
def test_a_bad_constraint_is_refused_at_submit_in_one_line(client, sampling, message):
    with pytest.raises(ValueError) as e:
        client.submit("x", sampling=sampling)
    assert message in str(e.value) and "\n" not in str(e.value)
    assert client.redis.xlen(client.keys.jobs()) == 0


def test_a_bad_constraint_written_past_the_client_fails_alone_at_the_worker(url, client, engine):
    bad = json.dumps({"prompt": "x", "sampling": {"regex": "(unclosed"}})
    with worker_thread(url, client.keys.queue, engine):
        client.redis.xadd(client.keys.jobs(), {"job_id": "bad-regex", "job": bad})
        good = client.submit("y", sampling={"choice": CHOICE, "max_tokens": 20})
        failed, ok = client.result("bad-regex", timeout=60), client.result(good, timeout=60)
    assert failed.status == p.FAILED and "sampling.regex must be a regular expression" in failed.error
    assert "unclosed group" in failed.error
    assert ok.status == p.SUCCEEDED and ok.text in CHOICE
