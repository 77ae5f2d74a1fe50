"""Structured output through the queue: constrained jobs from Client.submit run on a real worker (tiny model,
real redis-servers) and come back matching their constraints, their grammars compiled on preparation threads
before the engine thread sees them, so that a constraint slow to compile delays no other job; a compile past
its budget fails its job alone; a job in preparation can be cancelled and is handed back at the drain
deadline; a bad constraint is refused at submit, and one written past the client fails alone at the worker."""
from __future__ import annotations

import json
import re
import threading
import uuid

import jsonschema
import pytest
from queue_helpers import (
    new_queue,
    tiny_engine,
    url,  # noqa: F401 - the fixture: a module's Redis, on each server
    worker_thread,
)
from test_structured_output import UNFOLLOWABLE, gated

from producer import Client
from producer import protocol as p

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


def test_constrained_jobs_come_back_matching_with_grammars_compiled_off_the_engine_thread(url, client, engine,
                                                                                        monkeypatch):
    from engine.sampling.grammar import GrammarCache

    monkeypatch.setattr(engine, "grammars", GrammarCache(engine.tokenizer, engine.vocab_size,
                                                         engine.config.eos_token_id))  # nothing compiled yet
    asked_on = []
    compile_grammar = engine.compile_grammar

    def recording(params):
        asked_on.append(threading.current_thread().name)
        return compile_grammar(params)

    monkeypatch.setattr(engine, "compile_grammar", recording)
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
    assert asked_on and all(name.startswith("redline-prepare-") for name in asked_on)  # never the engine's thread


@pytest.mark.parametrize("sampling, message", [
    ({"json_schema": {"type": "object", "properties": {"a": {"type": "wat"}}}},
     ("sampling.json_schema must be a JSON schema (an object or its JSON text)", "got one that cannot be enforced")),
    ({"json_schema": "{nope"}, ("sampling.json_schema must be a JSON schema (an object or its JSON text)",
                                "got '{nope' (not JSON")),
    ({"regex": "[a-"}, ("sampling.regex must be a regular expression (Rust regex syntax)",
                        "got one that cannot be enforced")),
    ({"choice": []}, ("sampling.choice must be a non-empty list", )),
    ({"choice": ["a"], "regex": "a"}, ("give at most one of json_schema, regex, choice (got regex, choice)", )),
])
def test_a_bad_constraint_is_refused_at_submit_in_one_line(client, sampling, message):
    with pytest.raises(ValueError) as e:
        client.submit("x", sampling=sampling)
    assert all(part in str(e.value) for part in message) and "\n" not in str(e.value)
    assert client.redis.xlen(client.keys.jobs()) == 0


def test_a_bad_constraint_written_past_the_client_fails_alone_at_the_worker(url, client, engine):
    bad = json.dumps({"prompt": "x", "sampling": {"regex": "(unclosed"}})
    with worker_thread(url, client.keys.queue, engine):
        client.redis.xadd(client.keys.jobs(), {"job_id": "bad-regex", "job": bad})
        good = client.submit("y", sampling={"choice": CHOICE, "max_tokens": 20})
        failed, ok = client.result("bad-regex", timeout=60), client.result(good, timeout=60)
    assert failed.status == p.FAILED and "regex must be a regular expression" in failed.error
    assert "unclosed group" in failed.error and "\n" not in failed.error
    assert ok.status == p.SUCCEEDED and ok.text in CHOICE


def test_a_constraint_slow_to_check_holds_no_reader(url, client, engine, monkeypatch):
    """A job written past the client is checked at the worker; its constraint's compile check runs on a
    preparation thread, so while it takes its time the reader goes on reading other jobs."""
    from engine.sampling import grammar

    slow = f"[f-h]{{4}}-{uuid.uuid4().hex[:8]}"  # new to the process: its check is not cached yet
    began, gate, check = threading.Event(), threading.Event(), grammar._check

    def check_after_gate(kind, value):
        if value == slow:
            began.set()
            gate.wait(60)
        return check(kind, value)
    monkeypatch.setattr(grammar, "_check", check_after_gate)
    try:
        with worker_thread(url, client.keys.queue, engine):
            client.redis.xadd(client.keys.jobs(), {"job_id": "slow-check", "job": json.dumps(
                {"prompt": "x", "sampling": {"regex": slow, "max_tokens": 20}})})
            assert began.wait(60)
            others = [client.submit("Free", sampling={"max_tokens": 5}),
                      client.submit("Choose", sampling={"choice": CHOICE, "max_tokens": 20})]
            results = [client.result(job_id, timeout=60) for job_id in others]
            assert [r.status for r in results] == [p.SUCCEEDED] * 2, [r.error for r in results]
            assert client.status("slow-check").status != p.SUCCEEDED  # still being checked
            gate.set()
            late = client.result("slow-check", timeout=60)
    finally:
        gate.set()
    assert late.status == p.SUCCEEDED and re.fullmatch(slow, late.text)


@pytest.fixture
def slow_grammars(request, engine, monkeypatch):
    """The engine's grammars from a fresh cache whose compile of SLOW waits for a gate; its budget is the
    test's parameter, else far past the test's waits."""
    from engine.sampling.grammar import GrammarCache

    budget = getattr(request, "param", 120.0)
    cache = GrammarCache(engine.tokenizer, engine.vocab_size, engine.config.eos_token_id, budget_s=budget)
    monkeypatch.setattr(engine, "grammars", cache)
    began, gate = gated(cache, "regex", SLOW)
    yield began, gate
    gate.set()


SLOW = "[a-e]{3}-slow"


def test_a_constraint_slow_to_compile_delays_no_other_job(url, client, engine, slow_grammars):
    began, gate = slow_grammars
    with worker_thread(url, client.keys.queue, engine):
        slow = client.submit("Slow", sampling={"regex": SLOW, "max_tokens": 20})
        assert began.wait(60)
        others = [client.submit("Free", sampling={"max_tokens": 5}),
                  client.submit("Choose", sampling={"choice": CHOICE, "max_tokens": 20}),
                  client.submit("Code", sampling={"regex": REGEX, "max_tokens": 20})]
        results = [client.result(job_id, timeout=60) for job_id in others]
        assert [r.status for r in results] == [p.SUCCEEDED] * 3, [r.error for r in results]
        assert client.status(slow).status != p.SUCCEEDED  # still compiling
        gate.set()
        late = client.result(slow, timeout=60)
    assert late.status == p.SUCCEEDED and re.fullmatch(r"[a-e]{3}-slow", late.text)
    assert re.fullmatch(REGEX, results[2].text) and results[1].text in CHOICE


@pytest.mark.parametrize("slow_grammars", [1.0], indirect=True)
def test_a_constraint_past_its_compile_budget_fails_its_job_alone(url, client, engine, slow_grammars):
    began, gate = slow_grammars
    with worker_thread(url, client.keys.queue, engine):
        slow = client.submit("Slow", sampling={"regex": SLOW, "max_tokens": 20})
        again = client.submit("Slow again", sampling={"regex": SLOW, "max_tokens": 20})
        other = client.submit("Code", sampling={"regex": REGEX, "max_tokens": 20})
        results = [client.result(job_id, timeout=60) for job_id in (slow, again, other)]
    assert [r.status for r in results] == [p.FAILED, p.FAILED, p.SUCCEEDED]
    assert results[0].error == results[1].error == "the regex took longer than 1 s to compile; simplify it"


def test_a_job_cancelled_while_its_grammar_compiles_ends_cancelled(url, client, engine, slow_grammars):
    began, gate = slow_grammars
    with worker_thread(url, client.keys.queue, engine):
        job_id = client.submit("Slow", sampling={"regex": SLOW, "max_tokens": 20})
        assert began.wait(60)
        client.cancel(job_id)
        res = client.result(job_id, timeout=60)
    assert res.status == p.CANCELLED


def test_a_job_in_preparation_at_the_drain_deadline_is_handed_back(url, client, engine, slow_grammars):
    began, gate = slow_grammars
    with worker_thread(url, client.keys.queue, engine, drain_timeout=0) as first:
        job_id = client.submit("Slow", sampling={"regex": SLOW, "max_tokens": 20})
        assert began.wait(60)
    assert first.in_flight.jobs() == [] and client.status(job_id).status == "queued"
    assert client.redis.xpending(client.keys.jobs(0), p.GROUP)["pending"] == 0
    gate.set()
    engine.grammars = engine.grammars.__class__(engine.tokenizer, engine.vocab_size, engine.config.eos_token_id)
    with worker_thread(url, client.keys.queue, engine):
        res = client.result(job_id, timeout=60)
    assert res.status == p.SUCCEEDED and res.attempts == 2 and re.fullmatch(r"[a-e]{3}-slow", res.text)


@pytest.mark.parametrize("kind, value, message", UNFOLLOWABLE, ids=["huge-count", "self", "endless"])
def test_constraints_the_engine_cannot_follow_are_refused_at_submit(client, kind, value, message):
    with pytest.raises(ValueError) as e:
        client.submit("x", sampling={kind: value})
    assert message in str(e.value) and "\n" not in str(e.value) and len(str(e.value)) < 500
    assert client.redis.xlen(client.keys.jobs()) == 0
