"""The asyncio producer client: `Client`'s methods, awaited (and `stream` as an async iterator)."""
from __future__ import annotations

import time
from typing import Any, AsyncIterator, Iterable

import redis.asyncio as aredis

from . import protocol as p
from .client import (build_job, cancel_call, default_url, deltas_from_result, job_kwargs, parse_dead,
                     parse_delta, parse_status, remaining, requeue_call, submit_call)
from .connection import connect
from .scripts import ClientScripts


class AsyncClient:
    """Submit jobs to a queue and read their results, streams and status, from asyncio code."""

    def __init__(self, url: str | None = None, queue: str = "default", *,
                 redis_client: aredis.Redis | None = None) -> None:
        self.url = url or default_url()
        self.redis = redis_client or connect(self.url, asyncio=True, socket_timeout=None)
        self.keys = p.Keys(queue)
        self.scripts = ClientScripts(self.redis)

    async def close(self) -> None:
        await self.redis.aclose()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def submit(self, prompt: str | None = None, **kwargs: Any) -> str:
        """Enqueue one job; return its id. See `Client.submit`."""
        job = build_job(prompt, **kwargs)
        keys, args = submit_call(self.keys, [job])
        await self.scripts.submit(keys=keys, args=args)
        return job[0]

    async def submit_many(self, jobs: Iterable[dict | p.JobSpec], chunk: int = 500) -> list[str]:
        """Enqueue many jobs, `chunk` per script call, pipelined. See `Client.submit_many`."""
        built = [build_job(**job_kwargs(job)) for job in jobs]
        pipe = self.redis.pipeline(transaction=False)
        for i in range(0, len(built), chunk):
            keys, args = submit_call(self.keys, built[i:i + chunk])
            await self.scripts.submit(keys=keys, args=args, client=pipe)
        await pipe.execute()
        return [job_id for job_id, _, _ in built]

    async def result(self, job_id: str, timeout: float | None = None) -> p.JobResult:
        """Wait for the job's result (TimeoutError after `timeout` seconds)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            raw = await self.redis.hget(self.keys.job(job_id), "result")
            if raw:
                return p.JobResult.model_validate_json(raw)
            left = remaining(deadline)
            if left is not None and left <= 0:
                raise TimeoutError(f"job {job_id} has no result after {timeout} s")
            done = self.keys.done(job_id)
            moved = await self.redis.blmove(done, done, 0 if left is None else max(left, 0.01), "RIGHT", "LEFT")
            if moved is None:
                raise TimeoutError(f"job {job_id} has no result after {timeout} s")

    async def stream(self, job_id: str, after: str = "0-0",
                     timeout: float | None = None) -> AsyncIterator[p.TokenDelta]:
        """Token deltas as they are generated; resumable with `after`. See `Client.stream`."""
        key = self.keys.tokens(job_id)
        deadline = None if timeout is None else time.monotonic() + timeout
        if after == "0-0" and not await self.redis.exists(key):
            raw = await self.redis.hget(self.keys.job(job_id), "result")
            if raw:
                for delta in deltas_from_result(p.JobResult.model_validate_json(raw)):
                    yield delta
                return
        while True:
            left = remaining(deadline)
            if left is not None and left <= 0:
                raise TimeoutError(f"job {job_id}: no new tokens within {timeout} s")
            block = 0 if left is None else max(int(left * 1000), 1)
            reply = await self.redis.xread({key: after}, count=256, block=block)
            for _, entries in reply or []:
                for entry_id, fields in entries:
                    delta = parse_delta(entry_id, fields)
                    after = delta.id
                    yield delta
                    if delta.finished:
                        return

    async def cancel(self, job_id: str) -> bool:
        keys, args = cancel_call(self.keys, job_id)
        return bool(await self.scripts.cancel(keys=keys, args=args))

    async def status(self, job_id: str) -> p.JobStatus | None:
        fields = await self.redis.hmget(self.keys.job(job_id), "status", "attempts", "worker", "result",
                                        "last_error")
        names = (b"status", b"attempts", b"worker", b"result", b"last_error")
        return parse_status(job_id, {k: v for k, v in zip(names, fields) if v is not None})

    async def dead_letters(self, count: int = 100) -> list[p.DeadLetter]:
        return [parse_dead(i, f) for i, f in await self.redis.xrange(self.keys.dead, count=count)]

    async def requeue(self, dead_ids: list[str] | None = None) -> int:
        if dead_ids is None:
            letters = [parse_dead(i, f) for i, f in await self.redis.xrange(self.keys.dead)]
        else:
            letters = [parse_dead(i, f) for d in dead_ids for i, f in await self.redis.xrange(self.keys.dead, d, d)]
        n = 0
        for dead in letters:
            keys, args = requeue_call(self.keys, dead)
            n += int(await self.scripts.requeue(keys=keys, args=args))
        return n
