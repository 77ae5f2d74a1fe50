"""Online requests: `POST /v1/chat/completions`, `POST /v1/completions` and `POST /v1/embeddings`.

Each request is one job: its body becomes the job as a batch line's does (`producer.batch_format`), it is
enqueued with the request timeout as its deadline, and the answer is its result in the endpoint's shape;
with `stream: true`, server-sent events from the job's token stream, then `data: [DONE]`. A client that
goes away, or a request with no result within the timeout, cancels its job. The body is parsed and the job
validated (a schema's grammar compiled) on the gateway's Offload threads, never on the event loop. A
completion of several prompts (OpenAI's list of prompts) is a job a prompt, answered together.

A stream of n > 1 completions carries each as OpenAI does, `choices[0].index` naming it: the worker streams
every completion's text as it comes (each token delta names its completion), so the chunks of the choices
interleave; their finish reasons come from the result when the job ends.
"""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import AsyncIterator

import anyio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from .. import protocol as p
from ..batch_format import EMBEDDINGS, MAX_PROMPTS, request_job, response_body, several_prompts, usage_body
from ..client import build_job
from .errors import APIError, error_body, invalid
from .feed import ResultFeed, Submitter
from .offload import Offload

WAIT_SLICE_S = 1.0  # a waiting request checks this often whether its client is still there
RESULT_STATUS = {p.FAILED: 400, p.EXPIRED: 503, p.CANCELLED: 500}  # a job that did not succeed, as HTTP


class Online:
    """The online endpoints of one gateway, over its AsyncClient."""

    def __init__(self, client, model_name: str, timeout_s: float, metrics, offload: Offload,
                 adapters: tuple[str, ...] = ()) -> None:
        self.client, self.model_name, self.timeout_s = client, model_name, timeout_s
        self.adapters = adapters  # LoRA adapter names a request's model may give
        self.metrics, self.offload = metrics, offload
        self.feed, self.submitter = ResultFeed(client), Submitter(client)

    async def answer(self, request: Request, url: str, body: dict) -> Response:
        if url == EMBEDDINGS:
            return await self._embed(request, body)
        stream, include_usage = _stream_options(body)
        prompt = body.get("prompt") if url == "/v1/completions" else None
        if isinstance(prompt, list) and len(prompt) > 1 and isinstance(prompt[0], (str, list)):  # checked in _several
            if stream:
                raise invalid("stream: true takes one prompt (send each prompt as its own request, or set "
                              "stream: false)", "stream")
            return await self._several(request, url, body)
        chat = url == "/v1/chat/completions"
        job_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        prompt_only = _prompt_only(url, body)
        if prompt_only:  # the engine generates at least one token: one is made, and left out of the answer
            body = {**body, "max_tokens": 1}
        built, sampling = await self.offload(_build, url, body, job_id, stream, self.timeout_s,
                                            self.adapters)
        with_logprobs = sampling.get("logprobs") is not None
        if stream:
            await self.submitter.submit(built)
            deadline = time.monotonic() + self.timeout_s
            return await self._stream(request, job_id, chat, sampling.get("n", 1), include_usage, deadline,
                                      self._model(body))
        [result] = await self._succeeded(request, [built])
        return JSONResponse(response_body(url, result, with_logprobs, self._model(body), prompt_only))

    async def _several(self, request: Request, url: str, body: dict) -> Response:
        """A completion of several prompts, as OpenAI takes them: a job each (ids `<id>-<i>`), submitted together;
        the choices are each prompt's in turn (index i * n + j), the usage their sum. A job that does not succeed
        fails the request, and the others are cancelled."""
        job_id = f"cmpl-{uuid.uuid4().hex}"
        prompt_only = _prompt_only(url, body)
        if prompt_only:
            body = {**body, "max_tokens": 1}
        built = await self.offload(_build_each, url, body, job_id, self.timeout_s, self.adapters)
        sampling = built[0][1]
        results = await self._succeeded(request, [job for job, _ in built])
        model = self._model(body)
        answers = [response_body(url, r, sampling.get("logprobs") is not None, model, prompt_only) for r in results]
        n = sampling.get("n", 1)
        choices = [{**c, "index": i * n + c["index"]} for i, a in enumerate(answers) for c in a["choices"]]
        usage = {k: sum(a["usage"][k] for a in answers) for k in ("prompt_tokens", "completion_tokens", "total_tokens")}
        return JSONResponse({**answers[0], "id": job_id, "choices": choices, "usage": usage})

    async def _embed(self, request: Request, body: dict) -> Response:
        """An embeddings request: one embedding job, its vectors in OpenAI's shape."""
        job_id = f"embd-{uuid.uuid4().hex}"
        built = await self.offload(_build_embedding, body, job_id, self.timeout_s)
        [result] = await self._succeeded(request, [built])
        return JSONResponse(response_body(EMBEDDINGS, result, False, self.model_name,
                                          base64_vectors=body.get("encoding_format") == "base64"))

    def _model(self, body: dict) -> str:
        """The model an answer names: an adapter the request named, else the base."""
        return body["model"] if body.get("model") in self.adapters else self.model_name

    async def _succeeded(self, request: Request, jobs: list[tuple[str, int, str]]) -> list[p.JobResult]:
        """Submit the jobs (as `build_job` returns them) together and wait for their results, which the results
        feed's reader brings, in order. A job that does not succeed fails the request; then, as when the wait
        ends otherwise, the jobs without a result yet are cancelled: nobody gets their answers."""
        ids = [job[0] for job in jobs]
        for job_id in ids:
            await self.feed.watch(job_id)
        results: list[p.JobResult] = []
        try:
            await asyncio.gather(*(self.submitter.submit(job) for job in jobs))
            deadline = time.monotonic() + self.timeout_s
            for job_id in ids:
                result = await self._wait(request, job_id, deadline, self.feed.result)
                if not result.ok:
                    raise _failed(result.status, result.error)
                results.append(result)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await asyncio.gather(*(self.client.cancel(job_id) for job_id in ids[len(results):]),
                                     return_exceptions=True)
            raise
        finally:
            for job_id in ids:
                self.feed.forget(job_id)
        return results

    async def _wait(self, request: Request, job_id: str, deadline: float, read):
        """`read(job_id, timeout=...)` (the result, or the first token delta) by WAIT_SLICE_S slices, checking
        between them that the client is still there; the job is cancelled if it is not, or at the deadline."""
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                await self.client.cancel(job_id)
                raise APIError(504, f"no result within {self.timeout_s:g} s (the gateway's request timeout); "
                                    "the request was cancelled")
            try:
                return await read(job_id, timeout=min(WAIT_SLICE_S, left))
            except TimeoutError:
                pass
            if await request.is_disconnected():
                await self.client.cancel(job_id)
                raise APIError(499, "the client went away; the request was cancelled")

    async def _first_delta(self, job_id: str, timeout: float) -> p.TokenDelta:
        return await anext(self.client.stream(job_id, timeout=timeout))

    async def _stream(self, request: Request, job_id: str, chat: bool, n: int, include_usage: bool,
                      deadline: float, model: str) -> Response:
        first = await self._wait(request, job_id, deadline, self._first_delta)
        if first.finished and first.status != p.SUCCEEDED and not first.text:
            raise _failed(first.status, first.error)  # refused before it ran: an answer, not a stream
        rest = self.client.stream(job_id, after=first.id or "0-0", timeout=max(deadline - time.monotonic(), 0.01))
        chunks = Chunks(job_id, chat, model, include_usage)
        return EventStream(self._events(job_id, first, rest, chunks, n), self.metrics)

    async def _events(self, job_id: str, first: p.TokenDelta, deltas: AsyncIterator[p.TokenDelta],
                      chunks: "Chunks", n: int) -> AsyncIterator[str]:
        finished = False
        try:
            for index in range(n):
                yield chunks.event(chunks.choice(index, role=True))
            sent, texts = [""] * n, [""] * n  # each completion's: what the client has, its current attempt's text
            delta = first
            while True:
                if delta.restart:
                    texts = [""] * n
                i = delta.completion if 0 <= delta.completion < n else 0
                texts[i] += delta.text
                if not (texts[i].startswith(sent[i]) or sent[i].startswith(texts[i])):
                    yield _error_event(500, "the request restarted on another worker and its new text differs "
                                            "from what was sent; send it again")
                    return
                if len(texts[i]) > len(sent[i]):
                    yield chunks.event(chunks.choice(i, content=texts[i][len(sent[i]):]))
                    sent[i] = texts[i]
                if delta.finished:
                    finished = True
                    async for event in self._ending(job_id, delta, chunks, n):
                        yield event
                    return
                delta = await anext(deltas)
        except TimeoutError:
            yield _error_event(504, f"no result within {self.timeout_s:g} s (the gateway's request timeout); "
                                    "the request was cancelled")
        finally:
            if not finished:  # the client went away, or the stream failed: stop using the GPU for it
                with anyio.CancelScope(shield=True):
                    await self.client.cancel(job_id)


    async def _ending(self, job_id: str, last: p.TokenDelta, chunks: "Chunks", n: int) -> AsyncIterator[str]:
        """The events after the job's last delta: an error event; or each completion's finish (the others'
        from the result), the usage when asked for, and [DONE]."""
        if last.status != p.SUCCEEDED:
            yield _error_event(RESULT_STATUS[last.status], f"the request {last.status}: {last.error}")
            return
        yield chunks.event(chunks.choice(0, finish_reason=last.finish_reason))
        result = await self.client.result(job_id, timeout=10) if n > 1 or chunks.include_usage else None
        for c in (result.outputs or [])[1:] if n > 1 else []:
            yield chunks.event(chunks.choice(c.index, finish_reason=c.finish_reason))
        if chunks.include_usage:
            yield chunks.event(usage=usage_body(result))
        yield "data: [DONE]\n\n"


class Chunks:
    """The stream's events: chat.completion.chunk or text_completion objects."""

    def __init__(self, job_id: str, chat: bool, model: str, include_usage: bool) -> None:
        self.job_id, self.chat, self.include_usage = job_id, chat, include_usage
        self.head = {"id": job_id, "object": "chat.completion.chunk" if chat else "text_completion",
                     "created": int(time.time()), "model": model}

    def choice(self, index: int, content: str = "", role: bool = False, finish_reason: str | None = None) -> dict:
        """Completion `index`'s next piece: its role (first), text, or finish reason (last)."""
        if self.chat:
            delta = {"role": "assistant", "content": ""} if role else {"content": content} if content else {}
            return {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        return {"index": index, "text": content, "logprobs": None, "finish_reason": finish_reason}

    def event(self, choice: dict | None = None, usage: dict | None = None) -> str:
        data = {**self.head, "choices": [] if choice is None else [choice]}
        if self.include_usage:
            data["usage"] = usage
        return f"data: {json.dumps(data)}\n\n"


class EventStream(StreamingResponse):
    """Server-sent events; the generator is closed however the response ends, so its job is never left
    running for a client that is gone."""

    def __init__(self, events: AsyncIterator[str], metrics) -> None:
        super().__init__(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.metrics = metrics

    async def __call__(self, scope, receive, send) -> None:
        self.metrics.open_streams.inc()
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.metrics.open_streams.dec()
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()


def _build(url: str, body: dict, job_id: str, stream: bool, deadline_s: float,
           adapters: tuple[str, ...] = ()) -> tuple[tuple[str, int, str], dict]:
    """(The validated job, as `build_job` returns it; its sampling) for a request body; 400 if it cannot run."""
    job, error = request_job(url, {k: v for k, v in body.items() if k not in ("stream", "stream_options")}, adapters)
    if error is not None:
        raise invalid(error)
    sampling = job["sampling"]
    if stream and any(sampling.get(name) is not None for name in ("best_of", "logprobs", "prompt_logprobs")):
        raise invalid("stream: true takes completions without best_of, logprobs or echo (leave them out, or set "
                      "stream: false)", "stream")
    try:
        return build_job(**{**job, "job_id": job_id, "stream": stream, "deadline_s": deadline_s}), sampling
    except ValueError as e:
        raise invalid(str(e)) from None


def _build_each(url: str, body: dict, job_id: str, deadline_s: float,
                adapters: tuple[str, ...]) -> list[tuple[tuple[str, int, str], dict]]:
    """`_build` of each of a request's several prompts, as job `<job_id>-<i>`; 400 if they are not prompts, or
    too many."""
    prompts = body["prompt"]
    if not several_prompts(prompts):
        raise invalid("a completion's prompt is a string, a list of token ids, or a list of those", "prompt")
    if len(prompts) > MAX_PROMPTS:
        raise invalid(f"prompt holds {len(prompts)} prompts; a request takes at most {MAX_PROMPTS}", "prompt")
    return [_build(url, {**body, "prompt": prompt}, f"{job_id}-{i}", False, deadline_s, adapters)
            for i, prompt in enumerate(prompts)]


def _build_embedding(body: dict, job_id: str, deadline_s: float) -> tuple[str, int, str]:
    """The validated embedding job of an embeddings request body; 400 if it cannot run."""
    job, error = request_job(EMBEDDINGS, body)
    if error is not None:
        raise invalid(error)
    try:
        return build_job(**{**job, "job_id": job_id, "deadline_s": deadline_s})
    except ValueError as e:
        raise invalid(str(e)) from None


def _prompt_only(url: str, body: dict) -> bool:
    """Whether a completion echoes its prompt with max_tokens 0: the prompt scored, nothing generated."""
    tokens = body.get("max_tokens")
    return (url == "/v1/completions" and body.get("echo") is True and tokens == 0
            and not isinstance(tokens, bool))


def _stream_options(body: dict) -> tuple[bool, bool]:
    stream, options = body.get("stream"), body.get("stream_options")
    if stream is not None and not isinstance(stream, bool):
        raise invalid(f"stream must be true or false, got {json.dumps(stream)[:40]}", "stream")
    if options is None:
        return bool(stream), False
    if not stream:
        raise invalid("stream_options needs stream: true", "stream_options")
    if not isinstance(options, dict) or set(options) - {"include_usage"} or not isinstance(
            options.get("include_usage", False), bool):
        raise invalid('stream_options takes {"include_usage": true|false} only', "stream_options")
    return True, options.get("include_usage", False)


def _failed(status: str, error: str | None) -> APIError:
    return APIError(RESULT_STATUS.get(status, 500), f"the request {status}: {error or 'no reason given'}")


def _error_event(status: int, message: str) -> str:
    return f"data: {json.dumps(error_body(status, message))}\n\n"
