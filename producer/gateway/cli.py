"""`redline serve`: the OpenAI-compatible HTTP gateway in front of a queue (uvicorn serving `create_app`)."""
from __future__ import annotations

import argparse
import errno
import logging
import socket

from .settings import GatewaySettings


def register(subparsers) -> None:
    parser = subparsers.add_parser("serve", help="an OpenAI-compatible HTTP gateway to the queue "
                                                 "(/v1/files, /v1/batches, /v1/chat/completions, ...)")
    parser.add_argument("--redis-url", default=None,
                        help="the queue's Redis (default: REDLINE_REDIS_URL / REDIS_URL, else the embedded "
                             "redis-server of a `redline worker` on this machine, else redis://localhost:6379/0)")
    parser.add_argument("--queue", default=None, help="the queue to submit to [default]")
    parser.add_argument("--host", default=None, help="address to listen on [127.0.0.1]; 0.0.0.0 for every interface")
    parser.add_argument("--port", type=int, default=None, help="port to listen on [8000]")
    parser.add_argument("--api-key", dest="api_keys", action="append", default=None, metavar="KEY",
                        help="a bearer key clients must send (repeatable; REDLINE_API_KEYS=k1,k2); none: no check")
    parser.add_argument("--model-name", default=None,
                        help="the model name /v1/models lists and responses carry [redline]")
    parser.add_argument("--lora", dest="lora", action="append", default=None, metavar="NAME",
                        help="a LoRA adapter name the workers serve (repeatable): listed by /v1/models, and a "
                             "request's model may name it")
    parser.add_argument("--max-file-bytes", type=int, default=None, help="largest upload to /v1/files [100 MiB]")
    parser.add_argument("--max-request-bytes", type=int, default=None, help="largest other request body [4 MiB]")
    parser.add_argument("--request-timeout", type=float, default=None,
                        help="seconds an online request waits for its result before it is cancelled (504) [600]")
    parser.add_argument("--header-timeout", type=float, default=None,
                        help="seconds a client has to send a request's head before its connection is closed [10]")
    parser.add_argument("--body-timeout", type=float, default=None,
                        help="seconds a request's body has after its head, plus one per 64 KiB of it, before the "
                             "request is answered 408 and its connection closed [30]")
    parser.add_argument("--max-connections", type=int, default=None,
                        help="client connections open at once; past it the one idle longest is closed, else 503 [1000]")
    parser.add_argument("--log-level", default=None, choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    parser.set_defaults(func=run_serve)


def settings_from_args(args: argparse.Namespace) -> GatewaySettings:
    """Settings from parsed flags; a flag left unset falls back to REDLINE_<NAME>, then the default."""
    from producer.client import default_url

    given = {k: v for k, v in vars(args).items() if k in GatewaySettings.model_fields and v is not None}
    settings = GatewaySettings(**given)
    if settings.redis_url is None:
        settings.redis_url = default_url()
    return settings


def check_can_listen(host: str, port: int) -> None:
    """One line (exit 1 for a port in use, 2 for a bad --host/--port) if the gateway cannot listen there."""
    from producer.cli import UsageError

    try:
        family, kind, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        with socket.socket(family, kind) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
            probe.bind(address)
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            raise UsageError(f"port {port} on {host} is in use (another `redline serve`?); stop what holds it or "
                             "give another --port", exit_code=1) from None
        raise UsageError(f"cannot listen on {host}:{port} ({e.strerror or e}); check --host and --port") from None


def run_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from producer.connection import check_server, connect, redact_url
    from producer.protocol import Keys

    settings = settings_from_args(args)
    args.redis_url = settings.redis_url  # the error handler names the Redis it could not reach
    Keys(settings.queue)  # a bad queue name is refused before anything starts
    password = {"password": settings.redis_password} if settings.redis_password else {}
    check_server(connect(settings.redis_url, **password), settings.redis_url)
    check_can_listen(settings.host, settings.port)  # before any log line; uvicorn would log a traceback, exit 3
    logging.basicConfig(level=settings.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from monitoring.gateway_metrics import GatewayMetrics

    from .app import REDIS_CONNECTIONS, create_app
    from .server import FILE_MARGIN, guarded_protocol, raise_file_limit

    metrics = GatewayMetrics(settings.queue, settings.model_name)
    app = create_app(settings, metrics)
    raise_file_limit(settings.max_connections + REDIS_CONNECTIONS + FILE_MARGIN)
    keys = (f"{len(settings.api_keys)} API key(s)" if settings.api_keys
            else "no API key (anyone who can connect may use it)")
    logging.getLogger("redline.gateway").info("gateway for queue %r on %s at http://%s:%d/v1, %s", settings.queue,
                                              redact_url(settings.redis_url), settings.host, settings.port, keys)
    uvicorn.run(app, host=settings.host, port=settings.port, log_level=settings.log_level.lower(),
                timeout_graceful_shutdown=30, http=guarded_protocol(settings, metrics))
    return 0
