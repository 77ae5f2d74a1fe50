"""Files (`/v1/files`): batch inputs that clients upload and batch outputs the gateway writes.

A file is one Redis hash (`Keys.file`): `meta`, the OpenAI file object as JSON, and `content`, its bytes;
`Keys.files` indexes them by creation time. Every gateway of the queue reads the same files, and they stay
until deleted. Bodies live in Redis' memory, so uploads are limited (`max_file_bytes`, 100 MiB by default).
"""
from __future__ import annotations

import json
import time
import uuid
from typing import Awaitable, Callable

from .. import protocol as p
from .errors import invalid, not_found

LIST_CHUNK = 200  # index entries read per round while a listing fills its page


def new_file_id() -> str:
    return f"file-{uuid.uuid4().hex}"


def file_object(file_id: str, filename: str, purpose: str, size: int, created_at: int) -> dict:
    return {"id": file_id, "object": "file", "bytes": size, "created_at": created_at, "filename": filename,
            "purpose": purpose, "status": "processed", "expires_at": None, "status_details": None}


class FileStore:
    """The files of one queue, in its Redis."""

    def __init__(self, redis, keys: p.Keys) -> None:
        self.redis, self.keys = redis, keys

    async def put(self, file_id: str, filename: str, purpose: str, content: bytes) -> dict:
        """Store a file under `file_id` (a later put of the same id replaces it) and return its object."""
        created = time.time()
        meta = file_object(file_id, filename, purpose, len(content), int(created))
        await self.redis.hset(self.keys.file(file_id), mapping={"meta": json.dumps(meta), "content": content})
        await self.redis.zadd(self.keys.files, {file_id: int(created * 1000)})
        return meta

    async def get(self, file_id: str) -> dict:
        raw = await self.redis.hget(self.keys.file(file_id), "meta")
        if raw is None:
            raise not_found("file", file_id)
        return json.loads(raw)

    async def content(self, file_id: str) -> bytes:
        raw = await self.redis.hget(self.keys.file(file_id), "content")
        if raw is None:
            raise not_found("file", file_id)
        return raw

    async def delete(self, file_id: str) -> dict:
        if not await self.redis.delete(self.keys.file(file_id)):
            raise not_found("file", file_id)
        await self.redis.zrem(self.keys.files, file_id)
        return {"id": file_id, "object": "file", "deleted": True}

    async def list(self, purpose: str | None, limit: int, after: str | None, order: str) -> dict:
        async def fetch(ids: list[str]) -> list[dict | None]:
            pipe = self.redis.pipeline(transaction=False)
            for file_id in ids:
                pipe.hget(self.keys.file(file_id), "meta")
            return [json.loads(raw) if raw else None for raw in await pipe.execute()]

        return await page(self.redis, self.keys.files, fetch, limit, after, order,
                          keep=lambda f: purpose is None or f["purpose"] == purpose)


async def page(redis, index: str, fetch: Callable[[list[str]], Awaitable[list[dict | None]]], limit: int,
               after: str | None, order: str = "desc", keep: Callable[[dict], bool] = lambda _: True) -> dict:
    """One page of an OpenAI list (`{"object": "list", "data", "first_id", "last_id", "has_more"}`) from an
    index sorted by creation time: up to `limit` objects after the id `after`, newest first for "desc"."""
    if not 1 <= limit <= 10_000:
        raise invalid(f"limit must be between 1 and 10000, got {limit}", "limit")
    if order not in ("asc", "desc"):
        raise invalid(f"order must be asc or desc, got {order!r}", "order")
    rank = (await redis.zrevrank(index, after) if order == "desc" else await redis.zrank(index, after)) \
        if after else -1
    if rank is None:
        raise invalid(f"after names no object: {after!r}", "after")
    start, data, has_more = rank + 1, [], False
    while not has_more:
        ids = [p.decode(i) for i in (await (redis.zrevrange if order == "desc" else redis.zrange)(
            index, start, start + LIST_CHUNK - 1))]
        if not ids:
            break
        start += len(ids)
        for obj in await fetch(ids):
            if obj is not None and keep(obj):
                if len(data) == limit:
                    has_more = True
                    break
                data.append(obj)
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": has_more}
