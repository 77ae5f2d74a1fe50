"""`redline worker` (also `python -m worker`): serve a queue with one engine until SIGTERM."""
from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from typing import NoReturn

from pydantic import ValidationError

from . import settings as worker_settings

DEFAULT_REDIS_PORT = 6379

log = logging.getLogger("redline.worker")


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "worker", help="serve a queue: Redis jobs → engine → results",
        description="Serve a queue. Every flag can also be set as REDLINE_<FLAG> (e.g. REDLINE_MAX_NUM_SEQS).")
    worker_settings.add_arguments(parser)
    parser.set_defaults(func=run_worker)


def run_worker(args: argparse.Namespace) -> int:
    from producer.cli import UsageError

    try:
        settings = worker_settings.from_args(args)
    except ValidationError as e:
        raise UsageError(describe_settings_error(e)) from None
    logging.basicConfig(level=settings.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if settings.lookahead is not None and not settings.cache_aware_admission:
        raise UsageError(f"--lookahead {settings.lookahead} reads jobs ahead for --cache-aware-admission: add "
                         "--cache-aware-admission, or leave --lookahead out")
    if not settings.model:
        raise UsageError("give --model (or REDLINE_MODEL): an HF hub id, a local model directory, "
                         "or 'tiny' (the built-in model with random weights)")

    from engine.config import EngineConfig
    from producer.connection import check_server, connect, is_cluster_url

    if settings.celery_queue and settings.redis_url and is_cluster_url(settings.redis_url):
        raise UsageError("--celery-queue needs a redis:// URL: Celery's Redis transport (kombu) does not "
                         "support Redis Cluster")
    client = None
    if settings.redis_url:  # a wrong URL is said at once, before anything loads
        args.redis_url = settings.redis_url  # the error handler names the Redis it could not reach
        client = connect(settings.redis_url, password=settings.redis_password)  # the URL's own password wins
        check_server(client, settings.redis_url)
    config = EngineConfig(settings.model, **settings.engine_kwargs)  # a bad option or model: said before Redis starts
    _check_adapters(settings, config)
    server = None if client else embedded_redis(settings.redis_data_dir)
    if server:
        settings.redis_url = server.url  # a Celery queue, if served, is read from the same Redis
    try:
        code = _serve(settings, config, client or connect(server.url))
    finally:
        if server:
            server.stop()
    end_process(code)


def end_process(code: int) -> NoReturn:
    """End the worker process once its results are written and its engine is shut down, without the
    interpreter's exit: that exit collects the Redis clients, each closing its connection pool under the
    pool's lock, while the worker's daemon threads (one blocked on a Redis that stopped answering, one sending
    CLIENT UNBLOCK) are frozen wherever they stand, perhaps holding that lock, and the process would then
    never end."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _check_adapters(settings, config) -> None:
    """Every --lora adapter's directory and config, said in one line before anything loads."""
    from engine.lora.adapter import read_adapter_config
    from producer.cli import UsageError

    for name, lora in settings.lora_requests.items():
        try:
            read_adapter_config(lora.path, config.max_lora_rank)
        except ValueError as e:
            raise UsageError(f"--lora {name}: {e}") from None
    if settings.lora and not config.enable_lora:
        raise UsageError("--lora needs enable_lora: leave --no-enable-lora out")


def embedded_redis(data_dir: str):
    """A redis-server of our own keeping its data in data_dir, on the default port when it is free,
    published for producers here. One line on stderr if data_dir is unusable or another server's."""
    from producer.cli import UsageError
    from producer.connection import redact_url
    from producer.embedded import DataDirInUse

    try:
        server = _start_embedded(data_dir)
    except DataDirInUse as e:
        raise UsageError(f"{e}: serve its queue with --redis-url, or give this worker another --redis-data-dir",
                         exit_code=1) from None
    except OSError as e:
        raise UsageError(f"cannot keep the embedded Redis's data in {data_dir} ({e.strerror or e}); "
                         "give another --redis-data-dir") from None
    except RuntimeError as e:
        raise UsageError(f"the embedded redis-server did not start (data in {data_dir}): {e}", exit_code=1) from None
    try:
        server.publish()
        reach = f"`redline submit` on this machine finds it; elsewhere: REDIS_URL={server.url}"
    except OSError as e:
        reach = f"producers: REDIS_URL={server.url} (could not publish it for this machine: {e})"
    print(f"no --redis-url: embedded Redis at {redact_url(server.url)}; data in {data_dir}; {reach}", flush=True)
    return server


def _start_embedded(data_dir: str):
    from producer.embedded import DataDirInUse, RedisServer, port_is_free

    if port_is_free(DEFAULT_REDIS_PORT):
        try:
            return RedisServer(port=DEFAULT_REDIS_PORT, data_dir=data_dir).start()
        except DataDirInUse:
            raise
        except RuntimeError:  # taken between the check and the start
            pass
    return RedisServer(data_dir=data_dir).start()


def _serve(settings, config, client) -> int:
    """Load the engine and serve until a signal; the engine is shut down however the worker ends."""
    from engine import LLMEngine

    from .loop import Worker
    from .stats import make_metrics

    # metrics first: /healthz and /readyz answer (live, not ready) while the model loads
    metrics = make_metrics(settings, os.path.basename(settings.model.rstrip("/")))
    engine = LLMEngine(config)
    try:
        worker = Worker(settings, engine, client, metrics)

        def on_signal(signum, frame) -> None:
            # the first signal drains; a second one hands running jobs back at once
            worker.stop(now=worker.stopping.is_set())

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
        return worker.run()
    finally:
        shutdown = getattr(engine, "shutdown", None)
        if shutdown:
            shutdown()


def describe_settings_error(err) -> str:
    """A WorkerSettings validation error on one line, naming the flags (and variables) at fault."""
    parts = []
    for e in err.errors(include_url=False):
        name = str(e["loc"][0]) if e["loc"] else ""
        where = f"--{name.replace('_', '-')} (or REDLINE_{name.upper()}): " if name else ""
        parts.append(f"{where}{e['msg'].removeprefix('Value error, ')}, got {e.get('input')!r}")
    return "; ".join(parts)


def main(argv: list[str] | None = None) -> int:
    """`python -m worker ...` is `redline worker ...`."""
    from .cli import main as redline_main

    return redline_main(["worker", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
