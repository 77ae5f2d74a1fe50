"""A worker on a thread of this process, with an embedded redis-server when no URL is given.

`redline demo` and `redline batch` use it to run jobs on this machine with nothing else set up.
"""
from __future__ import annotations

import threading
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator


@dataclass
class LocalQueue:
    url: str
    queue: str
    engine: object


@contextmanager
def local_worker(model: str | None, load_format: str | None = None, device: str = "auto",
                 redis_url: str | None = None, say=print) -> Iterator[LocalQueue]:
    """Start (embedded Redis and) an engine and a worker draining a fresh queue; stop both on exit."""
    from engine import LLMEngine
    from producer.connection import check_server, connect
    from producer.embedded import RedisServer

    from .loop import Worker
    from .settings import WorkerSettings

    if model is None:
        from engine.builtin import TINY_MODEL_DIR

        model, load_format = TINY_MODEL_DIR, load_format or "dummy"
        say("no --model given: using the tiny built-in model with RANDOM weights, so the completions are "
            "gibberish; pass --model <hf id or dir> for real text")
    server = None
    if redis_url is None:
        server = RedisServer().start()
        redis_url = server.url
        say(f"embedded redis-server {server.version()} at {redis_url}")
    worker = thread = None
    try:
        check_server(connect(redis_url), redis_url)  # an unreachable Redis is said before the model loads
        start = time.perf_counter()
        engine = LLMEngine(model, load_format=load_format or "auto", device=device)
        say(f"engine ready in {time.perf_counter() - start:.1f} s ({engine.config.device})")
        queue = f"local-{uuid.uuid4().hex[:8]}"
        settings = WorkerSettings(model=model, redis_url=redis_url, queue=queue, worker_name="local-worker",
                                  drain_timeout=30)
        worker = Worker(settings, engine, connect(redis_url))
        thread = threading.Thread(target=worker.run, name="redline-local-worker")
        thread.start()
        worker.ready.wait(30)
        yield LocalQueue(redis_url, queue, engine)
    finally:
        if worker is not None:
            worker.stop()
            thread.join()
        if server is not None:
            server.stop()
