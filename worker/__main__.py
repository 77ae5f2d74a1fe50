"""`redline worker` (also `python -m worker`): serve a queue with one engine until SIGTERM."""
from __future__ import annotations

import argparse
import logging
import os
import signal
import sys

from . import settings as worker_settings

log = logging.getLogger("redline.worker")


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "worker", help="serve a queue: Redis jobs → engine → results",
        description="Serve a queue. Every flag can also be set as REDLINE_<FLAG> (e.g. REDLINE_MAX_NUM_SEQS).")
    worker_settings.add_arguments(parser)
    parser.set_defaults(func=run_worker)


def run_worker(args: argparse.Namespace) -> int:
    settings = worker_settings.from_args(args)
    logging.basicConfig(level=settings.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not settings.model:
        print("redline worker: give --model (or REDLINE_MODEL): an HF hub id or a local model directory",
              file=sys.stderr)
        return 2

    import redis

    from engine import LLMEngine
    from producer.embedded import RedisServer, port_is_free

    from .loop import Worker, make_metrics

    server = None
    url = settings.redis_url
    if not url:
        server = RedisServer(port=6379 if port_is_free(6379) else None).start()
        url = server.url
        print(f"no --redis-url: started an embedded redis-server at {url} (producers: REDIS_URL={url})",
              flush=True)
    client = redis.Redis.from_url(url)
    try:
        client.ping()
    except redis.RedisError as e:
        print(f"redline worker: cannot reach Redis at {url}: {e}", file=sys.stderr)
        return 1
    engine = LLMEngine(settings.model, **settings.engine_kwargs)
    metrics = make_metrics(settings, os.path.basename(settings.model.rstrip("/")))
    worker = Worker(settings, engine, client, metrics)

    def on_signal(signum, frame) -> None:
        # the first signal drains; a second one hands running jobs back at once
        worker.stop(now=worker.stopping.is_set())

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        return worker.run()
    finally:
        shutdown = getattr(engine, "shutdown", None)
        if shutdown:
            shutdown()
        if server:
            server.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m worker", description=__doc__)
    worker_settings.add_arguments(parser)
    return run_worker(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
