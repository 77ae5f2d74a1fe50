"""Images through the queue: chat jobs with data-URL image parts on a real worker (a tiny random Qwen2.5-VL
written by transformers, a real redis-server) come back with the engine's own tokens, their images decoded
and preprocessed on preparation threads, so that a job slow to prepare delays no other; unusable images, and
images past the pixel budget of a job (counted from their headers, before any is decoded), fail their job
alone and the worker serves on; `redline batch` takes chat lines with image parts."""
from __future__ import annotations

import base64
import json
import threading

import pytest

from engine import LLMEngine, SamplingParams
from producer import Client
from producer import protocol as p
from queue_helpers import new_queue, redis_server, server_params, worker_thread
from tests.multimodal_helpers import data_url, make_vl_checkpoint, noise_image, png_bytes
from worker.cli import main

SAMPLING = {"max_tokens": 12, "temperature": 0, "ignore_eos": True}


def _chat(text: str, *images) -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": data_url(im) if not isinstance(im, str) else im}}
             for im in images]
    return [{"role": "user", "content": parts + [{"type": "text", "text": text}]}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_vl_checkpoint(tmp_path_factory.mktemp("qwen2_5_vl_queue"))


@pytest.fixture(scope="module")
def engine(model_dir):
    return LLMEngine(str(model_dir), device="cpu", kvcache_block_size=8, max_images_per_prompt=2,
                     max_image_bytes=60_000, max_pixels_per_prompt=PIXEL_BUDGET)


PIXEL_BUDGET = 20_000  # the jobs' images below have 12,544 pixels at most


@pytest.fixture(scope="module")
def expected(model_dir):
    """The engine alone on the jobs' conversations."""
    alone = LLMEngine(str(model_dir), device="cpu", kvcache_block_size=8)
    convs = [_chat("Describe it.", noise_image(84, 112, 1)), _chat("Compare them.", noise_image(56, 56, 2),
                                                                     noise_image(112, 84, 3)),
             [{"role": "user", "content": "Tell me a story"}]]
    outs = alone.chat(convs, SamplingParams(**SAMPLING), use_tqdm=False)
    return convs, [o.token_ids for o in outs]


@pytest.fixture(scope="module")
def url():
    with redis_server(server_params()[0].values[0]) as server:
        yield server.url


def test_image_jobs_through_the_queue_equal_the_engine_alone(url, engine, expected, monkeypatch):
    convs, tokens = expected
    prepared_on = []
    prepare = engine.images.prepare

    def recording(*args):
        prepared_on.append(threading.current_thread().name)
        return prepare(*args)

    monkeypatch.setattr(engine.images, "prepare", recording)
    with Client(url, new_queue()) as client, worker_thread(url, client.keys.queue, engine):
        ids = [client.submit(messages=c, sampling=SAMPLING) for c in convs]
        results = [client.result(i, timeout=120) for i in ids]
    assert [r.status for r in results] == ["succeeded"] * 3, [r.error for r in results]
    assert [r.token_ids for r in results] == tokens
    assert results[1].usage.prompt_tokens > 30  # image tokens counted: 4 + 12 of them, and the template's
    assert len(prepared_on) == 2 and all(name.startswith("redline-prepare-") for name in prepared_on)


def test_bad_images_fail_their_job_alone_and_the_worker_serves_on(url, engine, expected):
    convs, tokens = expected
    not_image = "data:image/png;base64," + base64.b64encode(b"hello, not a png").decode()
    big = noise_image(196, 196, 9)  # a PNG of noise: ~115 kB, past the worker's 60,000 bytes
    small = noise_image(56, 56, 4)
    with Client(url, new_queue()) as client, worker_thread(url, client.keys.queue, engine):
        bad = {
            client.submit(messages=_chat("What?", not_image), sampling=SAMPLING): "not an image in a known format",
            client.submit(messages=_chat("What?", big), sampling=SAMPLING): "the limit is 60,000 bytes per image",
            client.submit(messages=_chat("What?", small, small, small), sampling=SAMPLING):
                "3 images in one prompt; the limit is 2",
        }
        # past the client: nine images and a web address, written straight to the stream
        raw = {"messages": _chat("What?", *[small] * 9), "sampling": SAMPLING}
        web = {"messages": _chat("What?", "https://example.com/cat.png"), "sampling": SAMPLING}
        for job, message in ((raw, "9 images in one prompt; the limit is 8"), (web, "the worker fetches nothing")):
            job_id = p.new_job_id()
            client.redis.xadd(client.keys.jobs(0), {"job_id": job_id, "job": json.dumps(job)})
            bad[job_id] = message
        good = client.submit(messages=convs[0], sampling=SAMPLING)
        results = {job_id: client.result(job_id, timeout=120) for job_id in [*bad, good]}
    for job_id, message in bad.items():
        res = results[job_id]
        assert res.status == "failed" and message in res.error and "\n" not in res.error, res.error
    assert results[good].status == "succeeded" and results[good].token_ids == tokens[0]


def test_the_client_refuses_malformed_image_parts_at_submit(url):
    with Client(url, new_queue()) as client:
        with pytest.raises(ValueError, match="not a base64 data URL"):
            client.submit(messages=_chat("What?", "file:///etc/passwd"))
        with pytest.raises(ValueError, match="type must be 'text' or 'image_url'"):
            client.submit(messages=[{"role": "user", "content": [{"type": "video", "video": "x"}]}])


def test_redline_batch_takes_chat_lines_with_image_parts(model_dir, expected, tmp_path):
    convs, tokens = expected
    lines = [json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions",
                         "body": {"messages": c, "max_tokens": 12, "temperature": 0, "ignore_eos": True}})
             for i, c in enumerate(convs)]
    lines.append(json.dumps({"custom_id": "bad", "method": "POST", "url": "/v1/chat/completions",
                             "body": {"messages": _chat("What?", "http://example.com/a.png")}}))
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    rc = main(["batch", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "out.jsonl"), "--model", str(model_dir),
               "--device", "cpu"])
    out = {o["custom_id"]: o for o in map(json.loads, (tmp_path / "out.jsonl").read_text().splitlines())}
    assert set(out) == {"c0", "c1", "c2", "bad"}
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    for i, want in enumerate(tokens):
        body = out[f"c{i}"]["response"]["body"]
        assert body["choices"][0]["message"]["content"] == tok.decode(want, skip_special_tokens=True)
    assert out["bad"]["response"] is None and "the worker fetches nothing" in out["bad"]["error"]["message"]
    assert rc == 0  # a failed line is an error line in the output, not a failed run


def test_images_past_the_pixel_budget_fail_their_job_before_any_is_decoded(url, engine, expected):
    convs, tokens = expected
    whole = png_bytes(noise_image(112, 112, 5))
    # a second image whose header says 112x112 but whose pixels are cut off: were it decoded, that would fail
    cut = "data:image/png;base64," + base64.b64encode(whole[:len(whole) // 3]).decode()
    with Client(url, new_queue()) as client, worker_thread(url, client.keys.queue, engine):
        big = client.submit(messages=_chat("What?", noise_image(112, 112, 6), cut), sampling=SAMPLING)
        good = client.submit(messages=convs[1], sampling=SAMPLING)
        failed, ok = client.result(big, timeout=120), client.result(good, timeout=120)
    assert failed.status == "failed" and failed.error == (
        "the prompt's 2 images have 25,088 pixels in all; the limit is 20,000 pixels per prompt: send fewer or "
        "smaller images")
    assert ok.status == "succeeded" and ok.token_ids == tokens[1]


def test_a_job_slow_to_prepare_delays_no_other_job(url, engine, expected, monkeypatch):
    """A job whose images take long to prepare (held here until the others are done) starts when they are
    ready; the jobs read after it start at once."""
    convs, tokens = expected
    began, gate = threading.Event(), threading.Event()
    prepare = engine.images.prepare

    def slow_for_two_images(token_ids, images):
        if len(images) == 2:
            began.set()
            gate.wait(60)
        return prepare(token_ids, images)

    monkeypatch.setattr(engine.images, "prepare", slow_for_two_images)
    try:
        with Client(url, new_queue()) as client, worker_thread(url, client.keys.queue, engine):
            slow = client.submit(messages=convs[1], sampling=SAMPLING)
            assert began.wait(60)
            others = [client.submit(messages=convs[0], sampling=SAMPLING),
                      client.submit(messages=convs[2], sampling=SAMPLING)]
            results = [client.result(job_id, timeout=60) for job_id in others]
            assert client.status(slow).status != "succeeded"
            gate.set()
            late = client.result(slow, timeout=120)
    finally:
        gate.set()
    assert [r.token_ids for r in results] == [tokens[0], tokens[2]]
    assert late.status == "succeeded" and late.token_ids == tokens[1]
