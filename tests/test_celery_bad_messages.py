"""Celery messages that can neither kill nor bloat a worker: envelopes kombu cannot read, and compressed bodies
bounded by max_job_bytes. Raw messages are pushed onto the Celery queue's Redis list as kombu would read them,
then a real Celery producer's task shows the worker serving on."""
from __future__ import annotations

import base64
import bz2
import json
import re
import threading
import uuid
import zlib

import psutil
import pytest
from celery import Celery
from celery.result import AsyncResult

from producer import Client
from queue_helpers import tiny_engine, wait_for
from queue_helpers import url  # noqa: F401 - the fixture: a module's Redis, on each server
from test_celery import GREEDY, celery_worker, send
from worker.celery_source import TASK_NAME, unacked_key

try:
    from compression import zstd  # Python 3.14
except ImportError:
    from backports import zstd  # redline's dependency before 3.14

pytestmark = pytest.mark.filterwarnings("ignore:Call to deprecated setex:DeprecationWarning")

MAX_JOB_BYTES = 64 * 1024  # the workers' max_job_bytes here: a bomb is refused at this many bytes
BOMB_BYTES = 2**30  # what each bomb would expand to
BOMB_GROWTH_LIMIT = 256 * 2**20  # the worker's RSS may grow this much while it refuses a bomb (not a GiB)


@pytest.fixture(scope="module")
def engine():
    return tiny_engine(max_num_seqs=4)


@pytest.fixture
def producer(url):
    app = Celery("producer", broker=url, backend=url, set_as_current=False)
    yield app
    app.close()


def envelope(producer: Celery, **options) -> dict:
    """A real Celery task message as kombu's Redis transport stores it (sent to a queue nobody reads)."""
    scratch = f"scratch-{uuid.uuid4().hex[:8]}"
    producer.send_task(TASK_NAME, kwargs={"prompt": "x", "sampling": GREEDY}, queue=scratch, **options)
    with producer.connection_for_write() as conn:
        return json.loads(conn.default_channel.client.rpop(scratch))


def with_id(message: dict) -> tuple[dict, str]:
    """The message with a fresh task id in its headers (so its failure can be read back)."""
    task_id = str(uuid.uuid4())
    return {**message, "headers": {**message["headers"], "id": task_id}}, task_id


def push(redis, queue: str, raw) -> None:
    redis.lpush(queue, raw if isinstance(raw, bytes) else json.dumps(raw))


def assert_queue_empty(redis, queue: str) -> None:
    """Nothing left on the queue, and every message acked (a result is stored just before its ack)."""
    wait_for(lambda: not redis.hlen(unacked_key(queue)), 10, "every message acked")
    assert redis.llen(queue) == 0


def test_malformed_messages_are_dropped_or_failed_alone_and_the_worker_serves_on(url, producer, engine, caplog):
    good = envelope(producer)
    properties = good["properties"]
    dropped = [b"not json {", b"\xff\xfe binary", b"[" * 100_000, json.dumps(["a", "JSON", "list"]).encode(),
               {**good, "headers": ["a", "list"]}, {"__type__": "uuid", "__value__": 5}]
    failing = [({key: value for key, value in good.items() if key != "properties"}, "properties"),
               ({**good, "properties": {**properties, "body_encoding": "rot13"}}, "body_encoding 'rot13'"),
               ({**good, "properties": {**properties, "delivery_info": "somewhere"}}, "delivery_info"),
               ({**good, "properties": {**properties, "delivery_tag": None}}, "delivery_tag"),
               ({**good, "body": "%%% not base64 %%%"}, "could not read it")]
    failed = {}
    for message, words in failing:
        message, task_id = with_id(message)
        failed[task_id] = (message, words)
    with celery_worker(url, producer, engine, max_job_bytes=MAX_JOB_BYTES) as worker:
        queue, redis = worker.settings.celery_queue, Client(url, worker.settings.queue).redis
        for raw in [*dropped, *(message for message, _ in failed.values())]:
            push(redis, queue, raw)
        assert send(producer, worker, kwargs={"prompt": "after them", "sampling": GREEDY}).get(timeout=60)["status"] \
            == "succeeded"
        for task_id, (_, words) in failed.items():
            r = AsyncResult(task_id, app=producer)
            with pytest.raises(Exception, match=re.escape(words)) as raised:
                r.get(timeout=30)
            assert r.state == "FAILURE" and type(raised.value).__name__ == "JobFailed"
            assert "\n" not in str(raised.value) and len(str(raised.value)) <= 1000
        assert not worker.failed
        assert_queue_empty(redis, queue)
    drops = [r.getMessage() for r in caplog.records if r.getMessage().startswith("dropped a message")]
    assert len(drops) == len(dropped) and all("\n" not in line and len(line) < 1200 for line in drops), drops


def rss_growth_while(action) -> tuple[int, object]:
    """How far this process's RSS rose while `action()` ran (sampled every few ms), and what it returned."""
    process = psutil.Process()
    start, peak, done = process.memory_info().rss, [0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], process.memory_info().rss)
            done.wait(0.002)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        returned = action()
    finally:
        done.set()
        sampler.join()
    return max(peak[0], process.memory_info().rss) - start, returned


def zlib_bomb(size: int) -> bytes:
    """A zlib stream of `size` zero bytes, built from one repeated fully-flushed block (no GiB in memory here)."""
    chunk = bytes(16 * 2**20)
    compressor = zlib.compressobj(9)
    first = compressor.compress(chunk) + compressor.flush(zlib.Z_FULL_FLUSH)
    block = compressor.compress(chunk) + compressor.flush(zlib.Z_FULL_FLUSH)  # each later block: these bytes
    return first + block * (size // len(chunk) - 1) + compressor.flush()  # (its checksum is wrong: read to the end)


BOMBS = {
    "bzip2": lambda: bz2.compress(bytes(2**25)) * (BOMB_BYTES // 2**25),  # streams one after another, 46 B each
    "zlib": lambda: zlib_bomb(BOMB_BYTES),
    "zstd": lambda: zstd.compress(bytes(2**25)) * (BOMB_BYTES // 2**25),  # frames one after another
}


@pytest.mark.parametrize("compression", sorted(BOMBS))
def test_a_compression_bomb_fails_its_task_without_growing_the_worker(url, producer, engine, compression):
    message, task_id = with_id(envelope(producer, compression=compression))
    message["body"] = base64.b64encode(BOMBS[compression]()).decode()
    with celery_worker(url, producer, engine, max_job_bytes=MAX_JOB_BYTES) as worker:
        queue, redis = worker.settings.celery_queue, Client(url, worker.settings.queue).redis
        r = AsyncResult(task_id, app=producer)

        def refused() -> str:
            push(redis, queue, message)
            with pytest.raises(Exception) as raised:
                r.get(timeout=60)
            return str(raised.value)

        growth, error = rss_growth_while(refused)
        assert growth < BOMB_GROWTH_LIMIT, f"the worker grew by {growth / 2**20:.0f} MiB"
        assert f"the body decompresses to more than {MAX_JOB_BYTES:,} bytes" in error
        assert r.state == "FAILURE"
        assert send(producer, worker, kwargs={"prompt": "next", "sampling": GREEDY}).get(timeout=60)["status"] \
            == "succeeded"
        assert not worker.failed
        assert_queue_empty(redis, queue)


def test_bodies_within_max_job_bytes_run_compressed_and_larger_or_unbounded_ones_fail(url, producer, engine,
                                                                                     monkeypatch):
    import kombu.compression

    # a compression kombu knows but redline cannot bound: refused, never decompressed
    monkeypatch.setitem(kombu.compression._encoders, "application/x-reversed", lambda data: data[::-1])
    monkeypatch.setitem(kombu.compression._decoders, "application/x-reversed", lambda data: data[::-1])
    monkeypatch.setitem(kombu.compression._aliases, "reversed", "application/x-reversed")
    with celery_worker(url, producer, engine, max_job_bytes=MAX_JOB_BYTES) as worker:
        sent = [send(producer, worker, kwargs={"prompt": f"packed with {name}", "sampling": GREEDY}, compression=name)
                for name in ("zlib", "gzip", "bzip2", "lzma", "zstd")]
        reversed_ = send(producer, worker, kwargs={"prompt": "backwards", "sampling": GREEDY}, compression="reversed")
        padded = send(producer, worker, kwargs={"prompt": "y" * MAX_JOB_BYTES, "sampling": GREEDY}, compression="zlib")
        large = send(producer, worker, kwargs={"prompt_token_ids": [7] * MAX_JOB_BYTES, "sampling": GREEDY})
        assert [r.get(timeout=60)["status"] for r in sent] == ["succeeded"] * 5
        with pytest.raises(Exception, match=r"compression 'application/x-reversed' .*send with zlib, bzip2, lzma"):
            reversed_.get(timeout=30)
        with pytest.raises(Exception, match="decompresses to more than"):
            padded.get(timeout=30)
        with pytest.raises(Exception, match=f"the body is [0-9,]+ bytes; this worker takes at most {MAX_JOB_BYTES:,}"):
            large.get(timeout=30)
        redis = Client(url, worker.settings.queue).redis
        assert_queue_empty(redis, worker.settings.celery_queue)
