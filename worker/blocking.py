"""Connections of the worker's own for the reads that block (jobs, cancels)."""
from __future__ import annotations

import logging
import threading
import time

import redis

from producer.connection import UNAVAILABLE, own_connection

log = logging.getLogger("redline.worker")

STARTUP_WAIT_S = 30.0  # how long a starting worker waits for an unavailable Redis (a failover) before it exits


def when_available(call, what: str, stopping: threading.Event | None = None):
    """`call()`, retried while Redis is unavailable (a cluster's master just died, its replica not yet
    promoted) for up to STARTUP_WAIT_S: a worker starting during a failover waits for it, as its threads do."""
    deadline = time.monotonic() + STARTUP_WAIT_S
    while True:
        try:
            return call()
        except UNAVAILABLE as e:
            if time.monotonic() >= deadline or (stopping is not None and stopping.is_set()):
                raise
            log.warning("%s failed (%s); retrying in 0.5 s", what, e)
            time.sleep(0.5)


class BlockingConnection:
    """One connection of a thread's own, to the server that holds the queue's keys (in a Redis Cluster the
    node that serves the queue's slot), for calls that block.

    `unblock()` ends a call in progress from another thread: CLIENT UNBLOCK must reach the same server.
    `reopen()`, after a lost connection, finds that server again: a failover may have moved the slot.
    """

    def __init__(self, client, key: str) -> None:
        self.client, self.key = client, key
        self.redis = when_available(lambda: own_connection(client, key), "connecting to the queue's Redis")
        self.client_id = self._client_id()

    def reopen(self) -> None:
        """A new connection to the server that holds the key now; on failure the old one stays, and the
        caller's next call fails and retries as before."""
        try:
            fresh = own_connection(self.client, self.key, refresh=True)
        except UNAVAILABLE:
            return
        old, self.redis = self.redis, fresh
        old.close()
        self.client_id = self._client_id()

    def unblock(self) -> None:
        """End this connection's blocking call, from a thread of its own: a hung Redis never answers."""
        if self.client_id is not None:
            threading.Thread(target=self._send_unblock, args=(self.redis.connection_pool, self.client_id),
                             daemon=True).start()

    @staticmethod
    def _send_unblock(pool, client_id: int) -> None:
        """CLIENT UNBLOCK on a connection of this call's own to the pool's server, never one of the pool's: a
        thread left in the pool (its lock held) as the process ends would stop the exit's close of that pool."""
        own = redis.ConnectionPool(connection_class=pool.connection_class, **pool.connection_kwargs)
        try:
            redis.Redis(connection_pool=own).client_unblock(client_id)
        except redis.RedisError:
            pass  # the blocking call times out by itself within a second
        finally:
            own.disconnect()

    def _client_id(self) -> int | None:
        try:
            return self.redis.client_id()
        except redis.RedisError:
            return None
