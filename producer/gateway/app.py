"""The gateway's ASGI app (Starlette): routes, API keys, body limits and OpenAI-shaped errors.

The app holds no state of its own: files and batches are in Redis (`files`, `batches`), online requests
are jobs (`online`), so any number of gateways may serve one queue behind a load balancer.
"""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time

import redis
from starlette.applications import Starlette
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Match, Route

from monitoring.gateway_metrics import UNROUTED, GatewayMetrics

from ..aio import AsyncClient
from ..batch_format import ENDPOINTS, load_json
from ..connection import connect, redact_url
from .batches import BatchStore
from .errors import APIError, error_body, invalid
from .files import FileStore, new_file_id
from .offload import Offload
from .online import Online
from .settings import GatewaySettings

log = logging.getLogger("redline.gateway")

# Redis connections of one gateway: each online request holds one while it waits on its job's result, so
# requests past this many wait for a free one (redis-py's default pool of 100 would fail them)
REDIS_CONNECTIONS = 1024
MULTIPART_OVERHEAD = 64 * 1024  # an upload's body may exceed its file by this much (the form's other parts)
CREATED = int(time.time())
METHODS = {"GET", "POST", "DELETE", "HEAD", "PUT", "PATCH", "OPTIONS"}  # others are one label value: "other"


def create_app(settings: GatewaySettings, metrics: GatewayMetrics | None = None) -> Starlette:
    """The gateway for `settings.queue` on `settings.redis_url`, counting into `metrics` (its own if None)."""
    metrics = metrics or GatewayMetrics(settings.queue, settings.model_name)
    offload = Offload()
    password = {"password": settings.redis_password} if settings.redis_password else {}
    client = AsyncClient(settings.redis_url, settings.queue,
                         redis_client=connect(settings.redis_url, asyncio=True, pool_size=REDIS_CONNECTIONS,
                                              socket_timeout=None, **password))
    files = FileStore(client.redis, client.keys)
    adapters = tuple(settings.lora)
    batches = BatchStore(client, files, settings.model_name, metrics, offload, adapters)
    online = Online(client, settings.model_name, settings.request_timeout, metrics, offload, adapters)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        keeper = asyncio.create_task(batches.keep(), name="redline-batch-keeper")
        try:
            yield
        finally:
            keeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await keeper
            await online.feed.close()
            await client.close()

    async def upload(request: Request) -> Response:
        form = await _form(request)
        purpose, file = form.get("purpose"), form.get("file")
        if purpose != "batch":
            raise invalid(f"purpose must be 'batch' (this gateway keeps batch input files), got {purpose!r}", "purpose")
        if not isinstance(file, UploadFile):
            raise invalid("give the file as the multipart part `file`", "file")
        content = await file.read(settings.max_file_bytes + 1)
        if len(content) > settings.max_file_bytes:
            raise APIError(413, f"the file is over the gateway's limit of {settings.max_file_bytes:,} bytes",
                           code="file_too_large")
        return JSONResponse(await files.put(new_file_id(), file.filename or "upload.jsonl", purpose, content))

    async def list_files(request: Request) -> Response:
        q = request.query_params
        return JSONResponse(await files.list(q.get("purpose"), _int(q, "limit", 10_000), q.get("after"),
                                             q.get("order", "desc")))

    async def file_meta(request: Request) -> Response:
        return JSONResponse(await files.get(request.path_params["file_id"]))

    async def file_content(request: Request) -> Response:
        return Response(await files.content(request.path_params["file_id"]), media_type="application/octet-stream")

    async def delete_file(request: Request) -> Response:
        return JSONResponse(await files.delete(request.path_params["file_id"]))

    async def create_batch(request: Request) -> Response:
        return JSONResponse(await batches.create(await _json(request, offload)))

    async def list_batches(request: Request) -> Response:
        q = request.query_params
        return JSONResponse(await batches.list(_int(q, "limit", 20), q.get("after")))

    async def get_batch(request: Request) -> Response:
        return JSONResponse(await batches.advance(request.path_params["batch_id"]))

    async def cancel_batch(request: Request) -> Response:
        return JSONResponse(await batches.cancel(request.path_params["batch_id"]))

    def completions(url: str):
        async def endpoint(request: Request) -> Response:
            return await online.answer(request, url, await _json(request, offload))
        return endpoint

    # the base model, then each LoRA adapter (OpenAI's `parent` and `root` name the base, as vLLM lists them)
    models = {settings.model_name: {"id": settings.model_name, "object": "model", "created": CREATED,
                                    "owned_by": "redline"}}
    for name in adapters:
        models.setdefault(name, {"id": name, "object": "model", "created": CREATED, "owned_by": "redline",
                                 "parent": settings.model_name, "root": settings.model_name})

    async def list_models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": list(models.values())})

    async def get_model(request: Request) -> Response:
        found = models.get(request.path_params["model"])
        if found is None:
            raise APIError(404, f"no model {request.path_params['model']!r}; this gateway serves "
                                f"{', '.join(map(repr, models))}", code="model_not_found")
        return JSONResponse(found)

    async def healthz(request: Request) -> Response:
        return PlainTextResponse("ok\n")

    async def readyz(request: Request) -> Response:
        try:
            await client.redis.ping()
        except redis.RedisError as e:
            return PlainTextResponse(f"Redis unreachable: {str(e)[:200]}\n", status_code=503)
        return PlainTextResponse("ok\n")

    async def exposition(request: Request) -> Response:
        body, content_type = metrics.exposition()
        return Response(body, media_type=content_type)

    routes = [
        Route("/v1/files", upload, methods=["POST"]),
        Route("/v1/files", list_files, methods=["GET"]),
        Route("/v1/files/{file_id}", file_meta, methods=["GET"]),
        Route("/v1/files/{file_id}", delete_file, methods=["DELETE"]),
        Route("/v1/files/{file_id}/content", file_content, methods=["GET"]),
        Route("/v1/batches", create_batch, methods=["POST"]),
        Route("/v1/batches", list_batches, methods=["GET"]),
        Route("/v1/batches/{batch_id}", get_batch, methods=["GET"]),
        Route("/v1/batches/{batch_id}/cancel", cancel_batch, methods=["POST"]),
        *[Route(url, completions(url), methods=["POST"]) for url in ENDPOINTS],
        Route("/v1/models", list_models, methods=["GET"]),
        Route("/v1/models/{model:path}", get_model, methods=["GET"]),
        Route("/healthz", healthz, methods=["GET"]),
        Route("/readyz", readyz, methods=["GET"]),
        Route("/metrics", exposition, methods=["GET"]),
    ]

    async def api_error(request: Request, e: APIError) -> Response:
        return e.response()

    async def http_error(request: Request, e: HTTPException) -> Response:
        return JSONResponse(error_body(e.status_code, f"{request.method} {request.url.path}: {e.detail}"),
                            status_code=e.status_code)

    async def redis_error(request: Request, e: redis.RedisError) -> Response:
        log.warning("Redis failed: %s", e)
        return JSONResponse(error_body(503, f"the queue's Redis failed: {redact_url(str(e))[:300]}"), status_code=503)

    app = Starlette(routes=routes, lifespan=lifespan,
                    exception_handlers={APIError: api_error, HTTPException: http_error, redis.RedisError: redis_error})
    return Instrument(Guard(app, settings), routes, metrics)


class Instrument:
    """ASGI middleware outermost: every request's route, method, status and duration into the metrics (the
    ones Guard answers too)."""

    def __init__(self, app, routes: list[Route], metrics: GatewayMetrics) -> None:
        self.app, self.routes, self.metrics = app, routes, metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start, status = time.monotonic(), 500  # uvicorn answers 500 for an app that never started its answer

        async def send_noting_status(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_noting_status)
        finally:
            method = scope["method"] if scope["method"] in METHODS else "other"
            self.metrics.observe_request(self._route(scope), method, status, time.monotonic() - start)

    def _route(self, scope) -> str:
        """The path template of the route the request asks for (whatever its method), else UNROUTED."""
        matches = [(route.matches(scope)[0], route.path) for route in self.routes]
        return next((path for match, path in matches if match is Match.FULL),
                    next((path for match, path in matches if match is Match.PARTIAL), UNROUTED))


class Guard:
    """ASGI middleware in front of the app: the bearer API key (401) and the body's size (413), both
    answered before the app reads anything."""

    def __init__(self, app, settings: GatewaySettings) -> None:
        self.app = app
        self.keys = [key.encode() for key in settings.api_keys]
        self.max_request_bytes = settings.max_request_bytes
        self.max_upload_bytes = settings.max_file_bytes + MULTIPART_OVERHEAD

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        if self.keys and scope["path"].startswith("/v1/") and not self._authorized(headers):
            return await _answer(send, 401, "missing or wrong API key: send the header Authorization: Bearer KEY",
                                 "invalid_api_key")
        upload = scope["path"] == "/v1/files" and scope["method"] == "POST"
        limit = self.max_upload_bytes if upload else self.max_request_bytes
        message = f"the request body is over the gateway's limit of {limit:,} bytes"
        length = headers.get(b"content-length", b"")
        if length.isdigit() and int(length) > limit:
            return await _answer(send, 413, message, "request_too_large")
        received = 0

        async def limited_receive():
            nonlocal received
            event = await receive()
            received += len(event.get("body", b""))
            if received > limit:
                raise APIError(413, message, code="request_too_large")
            return event

        await self.app(scope, limited_receive, send)

    def _authorized(self, headers: dict) -> bool:
        scheme, _, key = headers.get(b"authorization", b"").partition(b" ")
        return scheme.lower() == b"bearer" and any(hmac.compare_digest(key.strip(), k) for k in self.keys)


async def _answer(send, status: int, message: str, code: str) -> None:
    body = json.dumps(error_body(status, message, code=code)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


async def _json(request: Request, offload: Offload) -> dict:
    return await offload(_parse_body, await request.body())


def _parse_body(raw: bytes) -> dict:
    body, error = load_json(raw)
    if error is not None:
        raise invalid(f"the body {error}")
    if not isinstance(body, dict):
        raise invalid("the body must be a JSON object")
    return body


async def _form(request: Request):
    if not request.headers.get("content-type", "").startswith("multipart/form-data"):
        raise invalid("POST /v1/files takes multipart/form-data with the parts `file` and `purpose`")
    form = await request.form(max_files=1, max_fields=8)
    unknown = sorted(set(form.keys()) - {"file", "purpose"})
    if unknown:
        raise invalid(f"unsupported form fields: {', '.join(u[:40] for u in unknown[:5])}", unknown[0][:40])
    return form


def _int(query, name: str, default: int) -> int:
    value = query.get(name)
    if value is None:
        return default
    try:
        return int(value)
    except ValueError:
        raise invalid(f"{name} must be an integer, got {value[:40]!r}", name) from None
