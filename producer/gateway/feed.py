"""How the gateway waits on hundreds of jobs at once: their results through one reader of the queue's results
feed (`ResultFeed`), their submissions batched into a few SUBMIT calls (`Submitter`). Per request, a blocking
Redis call and a connection of its own each, and a round trip per submit, took most of the event loop's time
in a burst of calls (docs/performance.md)."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import redis

from .. import protocol as p
from ..aio import AsyncClient
from ..client import submit_call

log = logging.getLogger("redline.gateway")

FEED_BLOCK_MS = 1000  # the feed reader's XREAD waits this long at most, then reads again
FEED_RETRY_S = 1.0  # after a Redis error the reader tries again this much later (waiters read their own meanwhile)
OWN_READ_EVERY_S = 30.0  # a watched job's waiter also reads its hash itself this often (a trimmed feed)
SUBMIT_CHUNK = 500  # jobs in one SUBMIT call of a `Submitter`


class ResultFeed:
    """The results of many jobs through one reader of the queue's results feed, for a process that waits on
    hundreds at once (the gateway): `await feed.watch(job_id)` before the job is submitted, then `await
    feed.result(job_id, timeout)` as often as it likes, and `feed.forget(job_id)` when done; no blocking Redis
    call, nor a connection, per waiting job. The reader starts where the feed ends before the first watch, so
    it sees every watched job's result unless it lost Redis for a while, or fell RESULTS_FEED_MAXLEN entries
    behind: a wait that times out after such a gap, or OWN_READ_EVERY_S after its last, reads the job itself."""

    def __init__(self, client: AsyncClient) -> None:
        self.client = client
        self._waiters: dict[str, list] = {}  # job id -> [its result's future, gaps and time at its last read]
        self._reader: asyncio.Task | None = None
        self._ready: asyncio.Event | None = None  # set once the reader knows where the feed ends
        self._gaps = 0  # times the reader may have missed entries: a Redis error, a new reader

    async def watch(self, job_id: str) -> None:
        """Have the reader keep `job_id`'s result (call it before the job can finish)."""
        if self._reader is None or self._reader.done():
            self._gaps += self._reader is not None
            self._ready = asyncio.Event()
            self._reader = asyncio.create_task(self._read(self._ready), name="redline-result-feed")
        await self._ready.wait()
        self._waiters.setdefault(job_id, [asyncio.get_running_loop().create_future(), self._gaps,
                                          time.monotonic()])

    def forget(self, job_id: str) -> None:
        self._waiters.pop(job_id, None)

    async def result(self, job_id: str, timeout: float) -> p.JobResult:
        """A watched job's result (TimeoutError after `timeout` seconds)."""
        waiter = self._waiters.get(job_id)
        if waiter is not None:
            try:
                return await asyncio.wait_for(asyncio.shield(waiter[0]), timeout)
            except asyncio.TimeoutError:
                now = time.monotonic()
                if waiter[1] == self._gaps and now - waiter[2] < OWN_READ_EVERY_S:
                    raise TimeoutError(f"job {job_id} has no result after {timeout} s") from None
                waiter[1:] = self._gaps, now
        raw = await self.client.redis.hget(self.client.keys.job(job_id), "result")
        if raw:
            return p.JobResult.model_validate_json(raw)
        raise TimeoutError(f"job {job_id} has no result after {timeout} s")

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader
            self._reader = None

    async def _read(self, ready: asyncio.Event) -> None:
        redis_, feed = self.client.redis, self.client.keys.results
        last = None
        try:
            while True:
                try:
                    if last is None:
                        newest = await redis_.xrevrange(feed, count=1)
                        last = newest[0][0] if newest else "0-0"
                        ready.set()
                    reply = await redis_.xread({feed: last}, count=1000, block=FEED_BLOCK_MS)
                except redis.RedisError as e:
                    self._gaps += 1
                    log.warning("results feed unreadable (%s); retrying in %g s", str(e) or type(e).__name__,
                                FEED_RETRY_S)
                    ready.set()  # waiters read their own job's hash meanwhile
                    await asyncio.sleep(FEED_RETRY_S)
                    continue
                wanted = []
                for _, entries in reply or []:
                    for entry_id, fields in entries:
                        last = entry_id
                        job_id = fields.get(b"job_id", b"").decode(errors="replace")
                        if job_id in self._waiters:
                            wanted.append(job_id)
                if wanted:
                    await self._deliver(wanted)
        finally:  # never leave a waiter waiting for a reader that is gone
            ready.set()

    async def _deliver(self, job_ids: list[str]) -> None:
        pipe = self.client.redis.pipeline(transaction=False)
        for job_id in job_ids:
            pipe.hget(self.client.keys.job(job_id), "result")
        try:
            raws = await pipe.execute()
        except redis.RedisError:
            self._gaps += 1  # each waiter reads its own job after its slice
            return
        for job_id, raw in zip(job_ids, raws):
            waiter = self._waiters.get(job_id)
            if not raw or waiter is None or waiter[0].done():
                continue
            try:
                waiter[0].set_result(p.JobResult.model_validate_json(raw))
            except ValueError as e:  # a result that does not parse fails its own request, not the reader
                waiter[0].set_exception(e)


class Submitter:
    """SUBMIT calls of many concurrent callers batched: `await submitter.submit(built)` for a job as `build_job`
    returns it; the jobs submitted while a call is in flight go together in the next (SUBMIT_CHUNK at most), so
    a burst of requests costs a few round trips, not one each."""

    def __init__(self, client: AsyncClient) -> None:
        self.client = client
        self._pending: list[tuple[tuple[str, int, str], asyncio.Future]] = []
        self._sender: asyncio.Task | None = None

    async def submit(self, built: tuple[str, int, str]) -> None:
        future = asyncio.get_running_loop().create_future()
        self._pending.append((built, future))
        if self._sender is None or self._sender.done():
            self._sender = asyncio.create_task(self._send(), name="redline-submitter")
        await future

    async def _send(self) -> None:
        await asyncio.sleep(0)  # the callers ready now join the first call
        while self._pending:
            batch, self._pending = self._pending[:SUBMIT_CHUNK], self._pending[SUBMIT_CHUNK:]
            keys, args = submit_call(self.client.keys, [built for built, _ in batch])
            try:
                await self.client.scripts.submit(keys=keys, args=args)
            except Exception as e:  # each caller's own error, as if it had called alone
                for _, future in batch:
                    if not future.done():
                        future.set_exception(e)
                continue
            for _, future in batch:
                if not future.done():
                    future.set_result(None)
