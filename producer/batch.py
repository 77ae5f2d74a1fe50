"""`redline batch in.jsonl -o out.jsonl`: an OpenAI Batch API input file run through the queue.

Each input line is a request `{"custom_id", "method": "POST", "url": "/v1/chat/completions" or
"/v1/completions", "body": {...}}`; each output line, in input order, is `{"id", "custom_id",
"response": {"status_code", "request_id", "body"}, "error"}` with a chat.completion or text_completion
body. A bad line becomes an error line; it never stops the batch.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import uuid
from dataclasses import dataclass, field

ENDPOINTS = ("/v1/chat/completions", "/v1/completions")
SUBMIT_CHUNK = 500
# request body field -> wire sampling field
SAMPLING_FIELDS = {"max_tokens": "max_tokens", "max_completion_tokens": "max_tokens", "temperature": "temperature",
                   "top_p": "top_p", "top_k": "top_k", "min_p": "min_p", "seed": "seed", "stop": "stop",
                   "ignore_eos": "ignore_eos"}
IGNORED_FIELDS = {"model", "user", "stream", "n", "logprobs", "top_logprobs", "frequency_penalty",
                  "presence_penalty", "response_format", "metadata"}


@dataclass
class BatchLine:
    custom_id: str | None
    url: str | None = None
    job: dict = field(default_factory=dict)
    error: str | None = None  # the line cannot run: why


def parse_line(raw: str) -> BatchLine:
    """One input line as a job for `Client.submit_many`, or the reason it cannot be one."""
    try:
        req = json.loads(raw)
    except json.JSONDecodeError as e:
        return BatchLine(None, error=f"line is not JSON: {e}")
    if not isinstance(req, dict):
        return BatchLine(None, error="line is not a JSON object")
    custom_id = req.get("custom_id")
    line = BatchLine(custom_id if isinstance(custom_id, str) else None, req.get("url"))
    body = req.get("body")
    if line.custom_id is None:
        line.error = "custom_id must be a string"
    elif req.get("method", "POST") != "POST":
        line.error = f"method must be POST, got {req.get('method')!r}"
    elif line.url not in ENDPOINTS:
        line.error = f"url must be one of {', '.join(ENDPOINTS)}, got {line.url!r}"
    elif not isinstance(body, dict):
        line.error = "body must be a JSON object"
    else:
        line.job, line.error = _job(line.url, body)
    return line


def _job(url: str, body: dict) -> tuple[dict, str | None]:
    unknown = set(body) - set(SAMPLING_FIELDS) - IGNORED_FIELDS - {"messages", "prompt"}
    if unknown:
        return {}, f"unsupported body fields: {', '.join(sorted(unknown))}"
    if body.get("n", 1) != 1:
        return {}, "only n=1 is supported"
    sampling = {wire: body[name] for name, wire in SAMPLING_FIELDS.items() if body.get(name) is not None}
    if isinstance(sampling.get("stop"), str):
        sampling["stop"] = [sampling["stop"]]
    job: dict = {"sampling": sampling, "stream": False}
    if url == "/v1/chat/completions":
        if not isinstance(body.get("messages"), list):
            return {}, "a chat completion needs messages"
        job["messages"] = body["messages"]
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            job["prompt"] = prompt
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            job["prompt_token_ids"] = prompt
        else:
            return {}, "a completion needs a prompt: a string or a list of token ids"
    return job, None


def output_line(line: BatchLine, request_id: str, result=None, error: str | None = None,
                model: str = "redline") -> dict:
    """The output line for one input line: its result, or an error."""
    out = {"id": f"batch_req_{request_id}", "custom_id": line.custom_id, "response": None, "error": None}
    error = error or line.error or (result.error if result is not None and not result.ok else None)
    if error is not None:
        out["error"] = {"code": getattr(result, "status", None) or "invalid_request", "message": error}
        return out
    usage = {"prompt_tokens": result.usage.prompt_tokens, "completion_tokens": result.usage.completion_tokens,
             "total_tokens": result.usage.prompt_tokens + result.usage.completion_tokens}
    if line.url == "/v1/chat/completions":
        choice = {"index": 0, "message": {"role": "assistant", "content": result.text},
                  "finish_reason": result.finish_reason}
        kind = "chat.completion"
    else:
        choice = {"index": 0, "text": result.text, "finish_reason": result.finish_reason}
        kind = "text_completion"
    body = {"id": request_id, "object": kind, "created": int(time.time()), "model": model,
            "choices": [choice], "usage": usage}
    out["response"] = {"status_code": 200, "request_id": request_id, "body": body}
    return out


def run_batch(lines: list[str], client, output, timeout: float | None = None, model: str = "redline",
              progress: bool = True) -> tuple[int, int]:
    """Submit every good line, write one output line per input line in order; (succeeded, failed)."""
    from tqdm.auto import tqdm

    parsed = [parse_line(raw) for raw in lines]
    batch_id = uuid.uuid4().hex[:12]
    request_ids = [f"{batch_id}-{i}" for i in range(len(parsed))]
    good = [i for i, line in enumerate(parsed) if line.error is None]
    submit_errors: dict[int, str] = {}
    for start in range(0, len(good), SUBMIT_CHUNK):
        chunk = good[start:start + SUBMIT_CHUNK]
        try:  # pipelined; a chunk holding an invalid request is sent again one by one
            client.submit_many([{**parsed[i].job, "job_id": request_ids[i]} for i in chunk])
            continue
        except ValueError:
            pass
        for i in chunk:
            try:
                client.submit(**parsed[i].job, job_id=request_ids[i])
            except ValueError as e:
                submit_errors[i] = str(e)
    succeeded = failed = 0
    with tqdm(total=len(parsed), desc="batch", unit="req", disable=not progress) as bar:
        for i, line in enumerate(parsed):
            result = None
            if line.error is None and i not in submit_errors:
                result = client.result(request_ids[i], timeout=timeout)
            out = output_line(line, request_ids[i], result, submit_errors.get(i), model)
            output.write(json.dumps(out) + "\n")
            succeeded += out["error"] is None
            failed += out["error"] is not None
            bar.update(1)
    return succeeded, failed


def register(subparsers) -> None:
    parser = subparsers.add_parser("batch", help="run an OpenAI Batch API file (JSONL) through the queue")
    parser.add_argument("input", help="JSONL of requests to /v1/chat/completions or /v1/completions")
    parser.add_argument("-o", "--output", required=True, help="JSONL of results, one per input line, in order")
    parser.add_argument("--redis-url", default=None,
                        help="a queue with running workers; default: run the jobs here (embedded Redis + worker)")
    parser.add_argument("--queue", default="default", help="with --redis-url: the queue to submit to")
    parser.add_argument("--model", default=None,
                        help="without --redis-url: the model to run (default: the tiny built-in random model)")
    parser.add_argument("--load-format", default=None)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--timeout", type=float, default=None, help="seconds to wait for each result")
    parser.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    from producer import Client

    try:
        with open(args.input) as f:
            lines = [raw for raw in f if raw.strip()]
    except OSError as e:
        print(f"cannot read {args.input}: {e}", file=sys.stderr)
        return 2
    start = time.perf_counter()
    with open(args.output, "w") as output:
        if args.redis_url:
            ok, bad = run_batch(lines, Client(args.redis_url, args.queue), output, args.timeout)
        else:
            from worker.local import local_worker
            with local_worker(args.model, args.load_format, args.device,
                              say=lambda m: print(m, file=sys.stderr)) as local:
                ok, bad = run_batch(lines, Client(local.url, local.queue), output, args.timeout,
                                    model=args.model or "tiny-random")
    print(f"{ok} succeeded, {bad} failed in {time.perf_counter() - start:.1f} s; results in {args.output}",
          file=sys.stderr)
    return 0  # failed requests are results too: each has its error line in the output
