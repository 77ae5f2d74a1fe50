"""producer/gateway/feed.py on a real redis-server: the gateway's waiters get their results from one reader of
the results feed, a result the feed never announced is still found, and a burst of submits is a few calls."""
from __future__ import annotations

import asyncio
import json

import pytest

from producer import protocol as p
from producer.aio import AsyncClient
from producer.client import build_job
from producer.embedded import RedisServer
from producer.gateway import feed as feed_module
from producer.gateway.feed import ResultFeed, Submitter
from queue_helpers import new_queue


@pytest.fixture(scope="module")
def url():
    with RedisServer() as server:
        yield server.url


def _calls(info: dict, command: str) -> int:
    return info.get(f"cmdstat_{command}", {}).get("calls", 0)


def test_a_burst_of_submits_is_a_few_script_calls_and_each_waiter_gets_its_own_result(url):
    async def run():
        client = AsyncClient(url, new_queue())
        feed, submitter = ResultFeed(client), Submitter(client)
        try:
            built = [build_job(prompt=f"job {i}", sampling={"max_tokens": 1}) for i in range(50)]
            for job in built:
                await feed.watch(job[0])
            before = await client.redis.info("commandstats")
            await asyncio.gather(*(submitter.submit(job) for job in built))
            after = await client.redis.info("commandstats")
            scripts = sum(_calls(after, c) - _calls(before, c) for c in ("evalsha", "eval"))
            assert 1 <= scripts <= 3
            assert sum([await client.redis.xlen(k) for k in client.keys.all_jobs()]) == 50
            # ended from elsewhere (as a worker ends them): each waiter gets its job's result, no other
            canceller = AsyncClient(url, client.keys.queue)
            for job in built[::2]:
                assert await canceller.cancel(job[0])
            await canceller.close()
            results = await asyncio.gather(*(feed.result(job[0], timeout=5) for job in built[::2]))
            assert [r.job_id for r in results] == [job[0] for job in built[::2]]
            assert {r.status for r in results} == {p.CANCELLED}
            with pytest.raises(TimeoutError):
                await feed.result(built[1][0], timeout=0.2)
        finally:
            await feed.close()
            await client.close()
    asyncio.run(run())


@pytest.mark.parametrize("own_read_every_s, found", [(0.0, True), (30.0, False)])
def test_a_result_the_feed_never_announces_is_read_by_its_waiter_in_time(url, monkeypatch, own_read_every_s, found):
    monkeypatch.setattr(feed_module, "OWN_READ_EVERY_S", own_read_every_s)

    async def run():
        client = AsyncClient(url, new_queue())
        feed = ResultFeed(client)
        try:
            job_id = "unannounced"
            await feed.watch(job_id)
            result = p.JobResult(job_id=job_id, status=p.SUCCEEDED, text="hi")
            await client.redis.hset(client.keys.job(job_id), "result", json.dumps(result.model_dump(mode="json")))
            if found:
                assert (await feed.result(job_id, timeout=0.2)).text == "hi"
            else:
                with pytest.raises(TimeoutError):
                    await feed.result(job_id, timeout=0.2)
        finally:
            await feed.close()
            await client.close()
    asyncio.run(run())


def test_a_result_that_does_not_parse_fails_its_own_wait_and_the_reader_goes_on(url):
    async def run():
        client = AsyncClient(url, new_queue())
        feed = ResultFeed(client)
        try:
            for job_id in ("broken", "fine"):
                await feed.watch(job_id)
            good = p.JobResult(job_id="fine", status=p.SUCCEEDED, text="ok")
            for job_id, raw in (("broken", "{not json"), ("fine", json.dumps(good.model_dump(mode="json")))):
                await client.redis.hset(client.keys.job(job_id), "result", raw)
                await client.redis.xadd(client.keys.results, {"job_id": job_id, "status": "succeeded"})
            with pytest.raises(ValueError):
                await feed.result("broken", timeout=5)
            assert (await feed.result("fine", timeout=5)).text == "ok"
        finally:
            await feed.close()
            await client.close()
    asyncio.run(run())
