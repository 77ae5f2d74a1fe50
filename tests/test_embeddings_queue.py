"""Embedding jobs through the queue: Client and AsyncClient `submit(embed=...)` and a real Celery producer's
`redline.embed`, served by a real worker on a tiny embedding model, against LLM.embed."""
from __future__ import annotations

import asyncio

import pytest
import torch
from celery import Celery
from test_embeddings import TEXTS, make_embedding_model

from engine import LLMEngine
from producer import AsyncClient, Client
from queue_helpers import new_queue, worker_thread
from queue_helpers import url  # noqa: F401 - the fixture: a module's Redis, on each server
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
    ({"embed": []}, "at least 1 item"),
    ({"embed": ["x"] * 2049}, "at most 2048 items"),
    ({"embed": ["x" * 65_537]}, "at most 65536 characters"),
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
