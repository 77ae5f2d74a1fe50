"""Malformed stream entries, written with raw XADD, each end as a failed result with a clear error; the
valid jobs between them complete and the worker keeps serving."""
from __future__ import annotations

import json

import pytest

from producer import Client
from producer import protocol as p
from queue_helpers import new_queue, tiny_engine, worker_thread
from queue_helpers import url  # noqa: F401 - the fixture: a module's Redis, on each server

MAX_MODEL_LEN = 128
VALID = {"prompt_token_ids": [1, 2, 3], "sampling": {"temperature": 0.0, "max_tokens": 4, "ignore_eos": True}}


def spec(**fields) -> str:
    return json.dumps({"prompt": "hi", **fields})


def sampling(**fields) -> str:
    return json.dumps({"prompt": "hi", "sampling": fields})


# (kind, job field (None: absent), job_id field (None: absent), words the error must contain)
CASES = [
    ("not-json", "{this is not json", "", "Invalid JSON"),
    ("json-array", "[1, 2]", "", "object"),
    ("json-null", "null", "", "object"),
    ("json-number", "42", "", "object"),
    ("bad-utf8", b"\xff\xfe{\"prompt\": 1}", "", "JSON"),
    ("prompt-number", json.dumps({"prompt": 42}), "", "prompt: Input should be a valid string"),
    ("max-tokens-string", sampling(max_tokens="ten"), "", "sampling.max_tokens"),
    ("max-tokens-bool", sampling(max_tokens=True), "", "sampling.max_tokens"),
    ("temperature-string", sampling(temperature="hot"), "", "sampling.temperature"),
    ("stop-number", sampling(stop=5), "", "sampling.stop"),
    ("messages-string", json.dumps({"messages": "hello"}), "", "messages"),
    ("message-without-role", json.dumps({"messages": [{"content": "hi"}]}), "", "messages.0.role"),
    ("token-ids-strings", json.dumps({"prompt_token_ids": ["a", "b"]}), "", "prompt_token_ids.0"),
    ("stream-string", spec(stream="yes"), "", "stream"),
    ("negative-max-tokens", sampling(max_tokens=-5), "", "sampling.max_tokens: Input should be greater than or equal to 1"),
    ("zero-max-tokens", sampling(max_tokens=0), "", "sampling.max_tokens"),
    ("negative-temperature", sampling(temperature=-1), "", "sampling.temperature"),
    ("zero-top-p", sampling(top_p=0), "", "sampling.top_p"),
    ("no-prompt", json.dumps({"sampling": {"max_tokens": 3}}), "", "exactly one of prompt, messages, prompt_token_ids"),
    ("two-prompts", json.dumps({"prompt": "a", "prompt_token_ids": [1]}), "", "exactly one of"),
    ("empty-token-ids", json.dumps({"prompt_token_ids": []}), "", "prompt_token_ids is empty"),
    ("unknown-field", spec(colour="red"), "", "colour: Extra inputs are not permitted"),
    ("priority-out-of-range", spec(priority=9), "", "priority 9"),
    ("negative-deadline", spec(deadline_s=-1), "", "deadline_s"),
    ("token-id-too-big", json.dumps({"prompt_token_ids": [1, 2, 5000]}), "", "token id 5000 at position 2 is outside the vocabulary"),
    ("token-id-negative", json.dumps({"prompt_token_ids": [-1]}), "", "prompt_token_ids.0: Input should be greater"),
    ("top-k-past-int64", sampling(top_k=2**63), "", "sampling.top_k"),
    ("seed-past-uint64", sampling(seed=2**64), "", "sampling.seed"),
    ("seed-below-int64", sampling(seed=-(2**63) - 1), "", "sampling.seed"),
    ("temperature-infinite", '{"prompt": "hi", "sampling": {"temperature": 1e999}}', "", "sampling.temperature"),
    ("ids-over-max-model-len", json.dumps({"prompt_token_ids": [7] * 200}), "", f"prompt has 200 tokens; max_model_len is {MAX_MODEL_LEN}"),
    ("text-over-max-model-len", spec(prompt="many words " * 300), "", f"max_model_len is {MAX_MODEL_LEN}"),
    ("no-job-field", None, "", "the entry has no job field"),
    ("no-job-id-field", json.dumps(VALID), None, "the entry has no job_id field"),
    ("empty-job-id", json.dumps(VALID), "=", "job_id '' is invalid"),
    ("job-id-with-space", json.dumps(VALID), "=has space", "job_id 'has space' is invalid"),
    ("job-id-too-long", json.dumps(VALID), "=" + "x" * 300, "is invalid"),
]
REPEATS = 8  # 37 kinds x 8 = 296 malformed entries, plus the megabyte ones


def _fields(kind: str, job, job_id, n: int) -> tuple[dict, str | None]:
    """The entry's fields, and the job id its result is filed under (None: the entry id)."""
    fields: dict = {}
    key = f"bad-{kind}-{n}"
    if job_id is None:
        key = None
    elif job_id.startswith("="):
        fields["job_id"] = job_id[1:]
        key = None
    else:
        fields["job_id"] = key
    if job is not None:
        fields["job"] = job
    else:
        fields["other"] = "x"
    return fields, key


@pytest.fixture(scope="module")
def engine():
    return tiny_engine(max_model_len=MAX_MODEL_LEN, max_num_seqs=16)


def test_malformed_entries_fail_clearly_and_valid_jobs_between_them_complete(url, engine):
    client = Client(url, new_queue())
    stream = client.keys.jobs(0)
    expected: list[tuple[str, str]] = []  # (result key, words in its error)
    valid: list[str] = []
    n = 0
    for repeat in range(REPEATS):
        for kind, job, job_id, words in CASES:
            n += 1
            fields, key = _fields(kind, job, job_id, n)
            entry_id = client.redis.xadd(stream, fields).decode()
            expected.append((key or entry_id, words))
            if n % 6 == 0:
                valid.append(f"valid-{n}")
                client.redis.xadd(stream, {"job_id": valid[-1], "job": json.dumps(VALID)})
    megabytes = [
        (spec(prompt="x" * (5 * 1024 * 1024)), "bytes; this worker takes at most"),
        (spec(prompt="lorem ipsum " * 90_000), f"max_model_len is {MAX_MODEL_LEN}"),
        (json.dumps({"prompt_token_ids": [5] * 300_000}), "prompt has 300000 tokens"),
    ]
    for i, (job, words) in enumerate(megabytes):
        client.redis.xadd(stream, {"job_id": f"big-{i}", "job": job})
        expected.append((f"big-{i}", words))
    client.redis.xadd(stream, {"job_id": "last-valid", "job": json.dumps(VALID)})
    valid.append("last-valid")

    with worker_thread(url, client.keys.queue, engine) as worker:
        for job_id in valid:
            res = client.result(job_id, timeout=120)
            assert res.status == "succeeded" and len(res.token_ids) == 4, (job_id, res.error)
        failures = [(key, words, client.result(key, timeout=30)) for key, words in expected]
        assert worker.in_flight.jobs() == []

    for key, words, res in failures:
        assert res.status == "failed", key
        assert words in res.error, (key, res.error)
        assert res.token_ids == [] and res.attempts == 0
    assert len(expected) >= 299
    assert client.redis.xlen(client.keys.results) == len(expected) + len(valid)
    assert client.redis.xlen(stream) == 0
    assert client.redis.xpending(stream, p.GROUP)["pending"] == 0


def test_an_error_of_one_job_inside_the_engine_fails_that_job_alone(url):
    """A request whose own data raises during a step (here its stop-string check, made to raise by
    wrapping the tokenizer) ends `failed` with the error; the jobs beside it succeed, the worker serves on."""
    from test_bad_input import _FailingTokenizer

    engine = tiny_engine(max_model_len=MAX_MODEL_LEN)
    client = Client(url, new_queue())
    greedy = {"temperature": 0.0, "max_tokens": 4, "ignore_eos": True}
    probe, other = engine.generate([[1, 2, 3], [8, 9]], greedy, use_tqdm=False)
    assert probe.token_ids[0] not in other.token_ids  # the good jobs' text never holds the bad token
    engine.tokenizer = _FailingTokenizer(engine.tokenizer, probe.token_ids[0])
    with worker_thread(url, client.keys.queue, engine):
        bad = client.submit(prompt_token_ids=[1, 2, 3], sampling={**greedy, "stop": ["zzz"]})
        good = [client.submit(prompt_token_ids=[8, 9], sampling=greedy) for _ in range(3)]
        res = client.result(bad, timeout=60)
        assert res.status == "failed" and "RuntimeError: cannot decode" in res.error
        assert all(client.result(job_id, timeout=60).token_ids == other.token_ids for job_id in good)
        after = client.submit(prompt_token_ids=[4, 5], sampling=greedy)
        assert client.result(after, timeout=60).ok
