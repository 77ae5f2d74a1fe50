"""LoRA adapters through the queue: a worker started with `--lora NAME=PATH` runs jobs that name an adapter
(`lora: NAME`) under it, from the Client and from a real Celery producer; a job naming an adapter the worker
does not serve fails alone."""
from __future__ import annotations

import pytest
from celery import Celery

from engine import LLMEngine
from producer import Client
from queue_helpers import new_queue, worker_thread
from queue_helpers import url  # noqa: F401 - the fixture: a module's Redis, on each server
from tests.conftest import hf_greedy, make_checkpoint
from tests.lora_helpers import ADAPTERS, make_adapter, merge_adapter
from worker.celery_source import TASK_NAME

pytestmark = pytest.mark.filterwarnings("ignore:Call to deprecated setex:DeprecationWarning")
MAX_NEW = 8
PROMPT = [17, 42, 99, 7, 256, 31]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A tiny Qwen3 base, two adapters by name, and transformers' greedy tokens under each (merged) and the base."""
    root = tmp_path_factory.mktemp("lora-queue")
    base = make_checkpoint("qwen3", root / "base")
    paths, expected = {}, {None: hf_greedy(base, [PROMPT], MAX_NEW)[0]}
    for i, (name, rank, alpha, targets, rslora) in enumerate(ADAPTERS[:2]):
        paths[name] = make_adapter(base, root / name, rank, alpha, targets, rslora, seed=i)
        expected[name] = hf_greedy(merge_adapter(base, paths[name], root / f"{name}-merged"), [PROMPT], MAX_NEW)[0]
    return base, paths, expected


@pytest.fixture(scope="module")
def engine(models):
    base, _, _ = models
    eng = LLMEngine(str(base), device="cpu", enable_lora=True, max_loras=1, max_lora_rank=16)
    yield eng
    eng.shutdown()


def _lora_flags(paths) -> list[str]:
    return [f"{name}={path}" for name, path in paths.items()]


def test_jobs_run_under_the_adapter_they_name(url, models, engine):
    base, paths, expected = models
    sampling = {"temperature": 0, "max_tokens": MAX_NEW}
    with worker_thread(url, new_queue(), engine, model=str(base), lora=_lora_flags(paths)) as worker:
        client = Client(url, queue=worker.settings.queue)
        ids = {name: client.submit(prompt_token_ids=PROMPT, sampling=sampling, lora=name) for name in paths}
        ids[None] = client.submit(prompt_token_ids=PROMPT, sampling=sampling)
        unknown = client.submit(prompt_token_ids=PROMPT, sampling=sampling, lora="nope")
        results = {name: client.result(job_id, timeout=120) for name, job_id in ids.items()}
        failed = client.result(unknown, timeout=120)
    assert {name: r.token_ids for name, r in results.items()} == expected
    assert all(r.status == "succeeded" for r in results.values())
    assert failed.status == "failed"
    assert failed.error == "this worker serves no LoRA adapter 'nope'; it serves: sql, chat"


def test_a_job_names_an_adapter_never_a_path(url):
    with pytest.raises(ValueError, match="lora"):
        Client(url, queue=new_queue()).submit(prompt="hi", lora="/etc/adapters")


def test_celery_task_runs_under_the_named_adapter(url, models, engine):
    base, paths, expected = models
    app = Celery("producer", broker=url, backend=url, set_as_current=False)
    try:
        with worker_thread(url, new_queue(), engine, model=str(base), lora=_lora_flags(paths),
                           celery_queue=new_queue()) as worker:
            kwargs = {"prompt_token_ids": PROMPT, "sampling": {"temperature": 0, "max_tokens": MAX_NEW}, "lora": "chat"}
            got = app.send_task(TASK_NAME, kwargs=kwargs, queue=worker.settings.celery_queue).get(timeout=120)
    finally:
        app.close()
    assert got["token_ids"] == expected["chat"]
