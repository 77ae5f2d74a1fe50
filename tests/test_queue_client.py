"""The producer clients against real redis-servers, with no worker running."""
from __future__ import annotations

import asyncio
import threading

import pytest

from producer import AsyncClient, Client
from producer import protocol as p
from queue_helpers import new_queue
from queue_helpers import url  # noqa: F401 - the fixture: a module's Redis, on each server


@pytest.fixture
def client(url):
    with Client(url, new_queue()) as c:
        yield c


def test_submit_enqueues_one_entry_with_the_job_json(client):
    job_id = client.submit("hello", sampling={"max_tokens": 5, "temperature": 0})
    [(entry_id, fields)] = client.redis.xrange(client.keys.jobs(0))
    assert fields[b"job_id"].decode() == job_id
    spec = p.JobSpec.model_validate_json(fields[b"job"])
    assert spec.prompt == "hello" and spec.sampling.max_tokens == 5 and spec.sampling.temperature == 0
    assert client.status(job_id).status == "queued"


def test_resubmitting_an_existing_job_id_does_not_enqueue_twice(client):
    assert client.submit("first", job_id="same") == "same"
    assert client.submit("second", job_id="same") == "same"
    assert client.submit_many([{"prompt": "third", "job_id": "same"}, {"prompt": "other", "job_id": "new"}]) == \
        ["same", "new"]
    entries = client.redis.xrange(client.keys.jobs(0))
    assert [f[b"job_id"] for _, f in entries] == [b"same", b"new"]
    assert p.JobSpec.model_validate_json(entries[0][1][b"job"]).prompt == "first"


@pytest.mark.parametrize("kwargs, message", [
    ({}, "exactly one of prompt, messages, prompt_token_ids"),
    ({"prompt": "a", "prompt_token_ids": [1]}, "exactly one of"),
    ({"prompt": "a", "sampling": {"max_tokens": -1}}, "sampling.max_tokens"),
    ({"prompt": "a", "sampling": {"temprature": 0}}, "sampling.temprature"),
    ({"prompt_token_ids": [1, "x"]}, "prompt_token_ids.1"),
    ({"prompt": "a", "priority": 5}, "priority 5"),
    ({"prompt": "a", "job_id": "has space"}, "job_id"),
    ({"messages": [{"content": "no role"}]}, "messages.0.role"),
])
def test_submit_rejects_a_bad_job_before_enqueueing(client, kwargs, message):
    kwargs = dict(kwargs)
    prompt = kwargs.pop("prompt", None)
    with pytest.raises(ValueError, match=message.replace(".", r"\.")):
        client.submit(prompt, **kwargs)
    assert all(client.redis.xlen(s) == 0 for s in client.keys.all_jobs())


def test_priorities_go_to_their_own_streams(client):
    ids = client.submit_many([{"prompt": "low"}, {"prompt": "high", "priority": 2}, {"prompt": "mid", "priority": 1}])
    assert [client.redis.xlen(client.keys.jobs(n)) for n in (0, 1, 2)] == [1, 1, 1]
    assert client.redis.xrange(client.keys.jobs(2))[0][1][b"job_id"].decode() == ids[1]


def test_cancelling_a_queued_job_ends_it_at_once_and_removes_its_entry(client):
    job_id = client.submit("never run")
    assert client.cancel(job_id) is True
    result = client.result(job_id, timeout=1)
    assert result.status == "cancelled" and result.error == "cancelled before it started"
    assert client.redis.xlen(client.keys.jobs(0)) == 0
    [delta] = list(client.stream(job_id, timeout=1))
    assert delta.finished and delta.status == "cancelled"
    assert client.cancel(job_id) is False  # already final
    assert client.cancel("no-such-job") is False


def test_result_blocks_on_one_command_and_times_out(client):
    client.redis.config_resetstat()
    with pytest.raises(TimeoutError):
        client.result("not-done", timeout=0.5)
    stats = client.redis.info("commandstats")
    assert stats["cmdstat_hget"]["calls"] == 1
    assert stats["cmdstat_blmove"]["calls"] == 1


def test_status_of_an_unknown_job_is_none(client):
    assert client.status("nope") is None


def test_async_client_submits_cancels_and_reads_status(url):
    async def scenario():
        async with AsyncClient(url, new_queue()) as c:
            ids = await c.submit_many([{"prompt_token_ids": [1, 2, 3]}, {"prompt": "x", "job_id": "a1"}])
            assert ids[1] == "a1"
            assert await c.submit("again", job_id="a1") == "a1"
            assert (await c.status("a1")).status == "queued"
            assert await c.cancel("a1")
            result = await c.result("a1", timeout=1)
            deltas = [d async for d in c.stream("a1", timeout=1)]
            with pytest.raises(TimeoutError):
                await c.result(ids[0], timeout=0.2)
            return result, deltas, await c.redis.xlen(c.keys.jobs(0))
    result, deltas, left = asyncio.run(scenario())
    assert result.status == "cancelled" and deltas[-1].finished and left == 1


def test_submit_many_validates_every_job_before_sending_any(client):
    with pytest.raises(ValueError, match="max_tokens"):
        client.submit_many([{"prompt": "fine"}, {"prompt": "bad", "sampling": {"max_tokens": 0}}])
    assert client.redis.xlen(client.keys.jobs(0)) == 0


def test_result_wakes_every_waiter_of_a_job(client):
    job_id = client.submit("x")
    got = []
    waiters = [threading.Thread(target=lambda: got.append(client.result(job_id, timeout=10).status))
               for _ in range(3)]
    for t in waiters:
        t.start()
    client.cancel(job_id)  # a queued job's cancel writes its final result, like a worker would
    for t in waiters:
        t.join()
    assert got == ["cancelled"] * 3
