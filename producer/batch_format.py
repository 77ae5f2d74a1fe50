"""The OpenAI Batch API's line format: an input line as a job, a result as an output line.

Each input line is a request `{"custom_id", "method": "POST", "url": "/v1/chat/completions",
"/v1/completions" or "/v1/embeddings", "body": {...}}`; each output line is `{"id", "custom_id", "response":
{"status_code", "request_id", "body"}, "error"}` with a chat.completion, text_completion or embeddings `list`
body (an embeddings line is one embedding job: `input` a text, texts, token ids or token-id lists,
`dimensions`, `encoding_format` float or base64); a completion's body has one choice per completion
(n of them), each with its logprobs in the endpoint's own shape when asked for; a completion with `echo: true`
starts with its prompt (its tokens' texts, and logprobs: the job asks `sampling.prompt_logprobs`). `response_format`
becomes a structured-output constraint: `{"type": "json_object"}` any JSON object, `{"type":
"json_schema", "json_schema": {"name", "schema", "strict"}}` that schema (enforced whatever `strict` says).
A line that cannot run gets an error line of its own.

The HTTP gateway (`producer.gateway`) uses the same mapping for its online requests (`request_job`,
`response_body`) and its batches.
"""
from __future__ import annotations

import base64
import json
import struct
import time
from collections.abc import Collection
from dataclasses import dataclass, field

from engine.sampling.params import nesting_exceeds

from .protocol import embed_inputs, embed_inputs_error, is_token_ids

EMBEDDINGS = "/v1/embeddings"
ENDPOINTS = ("/v1/chat/completions", "/v1/completions", EMBEDDINGS)
EMBEDDING_FIELDS = {"input", "dimensions", "encoding_format"}
ENCODING_FORMATS = ("float", "base64")  # base64: each vector's little-endian float32 bytes, as OpenAI sends them
# request body field -> wire sampling field (logprobs and top_logprobs: _logprobs, as each endpoint means them)
SAMPLING_FIELDS = {"max_tokens": "max_tokens", "max_completion_tokens": "max_tokens", "temperature": "temperature",
                   "top_p": "top_p", "top_k": "top_k", "min_p": "min_p", "seed": "seed", "stop": "stop",
                   "stop_token_ids": "stop_token_ids", "ignore_eos": "ignore_eos", "n": "n", "best_of": "best_of",
                   "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty",
                   "logit_bias": "logit_bias", "repetition_penalty": "repetition_penalty", "min_tokens": "min_tokens"}
LOGPROB_FIELDS = {"logprobs", "top_logprobs"}
# body fields not honoured yet -> the values that mean the same as leaving them out (null always does);
# honouring one is moving it to SAMPLING_FIELDS (and its output into output_line)
# parallel_tool_calls changes nothing without tools, whatever its value
NOT_YET = {"stream": (False,), "tools": ([],), "tool_choice": ("none",), "parallel_tool_calls": (True, False)}
ANY_JSON_OBJECT = {"type": "object"}  # response_format {"type": "json_object"}
# accepted and not used: the worker's model answers, nothing is stored for OpenAI's products, no tier is billed
INFORMATIONAL = {"model", "user", "metadata", "store", "service_tier"}
INPUTS = {"messages", "prompt"}
MAX_PROMPTS = 2048  # prompts of one online completion request (a job each), as many as an embeddings request's inputs
# how deep a request body or batch line may nest: a schema or a message nests a dozen levels, and deeper
# JSON would exhaust Python's recursion (near 1000) in the parser or the checks after it
MAX_JSON_DEPTH = 64


@dataclass
class BatchLine:
    custom_id: str | None
    url: str | None = None
    job: dict = field(default_factory=dict)
    error: str | None = None  # the line cannot run: why
    with_logprobs: bool = False  # the request asked for logprobs: its choices carry them
    base64: bool = False  # an embeddings request asked for encoding_format base64


def parse_line(raw: str, endpoint: str | None = None, adapters: Collection[str] = ()) -> BatchLine:
    """One input line as a job for `Client.submit_many`, or the reason it cannot be one. With `endpoint`,
    every line must ask for that one (an OpenAI batch names its endpoint once). adapters: see request_job."""
    req, error = load_json(raw)
    if error is not None:
        return BatchLine(None, error=f"line {error}")
    if not isinstance(req, dict):
        return BatchLine(None, error="line is not a JSON object")
    custom_id = req.get("custom_id")
    line = BatchLine(custom_id if isinstance(custom_id, str) else None, req.get("url"))
    body = req.get("body")
    if line.custom_id is None:
        line.error = "custom_id must be a string"
    elif req.get("method", "POST") != "POST":
        line.error = f"method must be POST, got {_shown(req.get('method'))}"
    elif line.url not in ENDPOINTS:
        line.error = f"url must be one of {', '.join(ENDPOINTS)}, got {_shown(line.url)}"
    elif endpoint is not None and line.url != endpoint:
        line.error = f"url must be the batch's endpoint {endpoint}, got {_shown(line.url)}"
    elif not isinstance(body, dict):
        line.error = "body must be a JSON object"
    else:
        line.job, line.error = request_job(line.url, body, adapters)
        line.with_logprobs = line.job.get("sampling", {}).get("logprobs") is not None
        line.base64 = line.url == EMBEDDINGS and body.get("encoding_format") == "base64"
    return line


def load_json(raw: str | bytes) -> tuple[object, str | None]:
    """(The JSON value of `raw`; or why it cannot be one: "is not JSON: ..." or "nests deeper than ...")."""
    too_deep = f"nests deeper than {MAX_JSON_DEPTH} levels; flatten it"
    try:
        value = json.loads(raw)
    except RecursionError:
        return None, too_deep
    except ValueError as e:  # UnicodeDecodeError too
        return None, f"is not JSON: {str(e)[:200]}"
    return (None, too_deep) if nesting_exceeds(value, MAX_JSON_DEPTH) else (value, None)


def mark_repeated_ids(lines: list[BatchLine]) -> None:
    """A custom_id must be unique in its batch, as OpenAI requires: a line repeating an earlier line's
    custom_id becomes an error line (the earlier one runs)."""
    first: dict[str, int] = {}
    for i, line in enumerate(lines):
        if line.custom_id is None:
            continue
        j = first.setdefault(line.custom_id, i)
        if j != i and line.error is None:
            line.error = (f"custom_id {_shown(line.custom_id)} repeats line {j + 1}'s; give every line its own "
                          "custom_id")


def _shown(value, limit: int = 40) -> str:
    text = json.dumps(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _is_noop(value, noops: tuple) -> bool:
    # False == 0 in Python: a bool must match a bool (logprobs=0 asks for the sampled token's logprob)
    return any(value == v and isinstance(value, bool) == isinstance(v, bool) for v in noops)


def request_job(url: str, body: dict, adapters: Collection[str] = ()) -> tuple[dict, str | None]:
    """(The job for the request body of one endpoint, as `Client.submit` takes it; or why it cannot run). A
    generation runs under the LoRA adapter its `lora` field names, or, where `model` is one of `adapters`
    (the gateway's --lora names), under that one."""
    if url == EMBEDDINGS:
        return embedding_job(body)
    unknown = sorted(set(body) - set(SAMPLING_FIELDS) - LOGPROB_FIELDS - set(NOT_YET) - INFORMATIONAL - INPUTS
                     - {"response_format", "echo", "lora"})
    if unknown:
        more = f" and {len(unknown) - 5} more" if len(unknown) > 5 else ""
        return {}, f"unsupported body fields: {', '.join(u[:30] for u in unknown[:5])}{more}"
    not_yet = [f"{name}={_shown(body[name])} is not supported yet (leave it out or use {_shown(noops[0])})"
               for name, noops in NOT_YET.items() if body.get(name) is not None and not _is_noop(body[name], noops)]
    if not_yet:
        return {}, "; ".join(not_yet)
    sampling = {wire: body[name] for name, wire in SAMPLING_FIELDS.items() if body.get(name) is not None}
    sampling.setdefault("max_tokens", None)  # OpenAI's default: the rest of the context (until max_model_len)
    if isinstance(sampling.get("stop"), str):
        sampling["stop"] = [sampling["stop"]]
    logprobs, error = _logprobs(url, body)
    if error is not None:
        return {}, error
    if logprobs is not None:
        sampling["logprobs"] = logprobs
    echo, error = _echo(url, body.get("echo"))
    if error is not None:
        return {}, error
    if echo:  # the prompt's tokens come back with their texts (and logprobs, as many top ones as the completion's)
        if body.get("max_tokens") == 0 and not isinstance(body["max_tokens"], bool):
            return {}, ("echo with max_tokens 0 (the prompt alone) is answered online (POST /v1/completions); "
                        "give a batch line max_tokens of at least 1")
        sampling["prompt_logprobs"] = logprobs or 0
    schema, error = _response_format(body.get("response_format"))
    if error is not None:
        return {}, error
    if schema is not None:
        sampling["json_schema"] = schema
    job: dict = {"sampling": sampling, "stream": False}
    lora = body.get("lora")
    if lora is None and isinstance(body.get("model"), str) and body["model"] in adapters:
        lora = body["model"]
    if lora is not None:
        job["lora"] = lora
    if url == "/v1/chat/completions":
        if not isinstance(body.get("messages"), list):
            return {}, "a chat completion needs messages"
        job["messages"] = body["messages"]
    else:
        prompt, error = _completion_prompt(body.get("prompt"))
        if error is not None:
            return {}, error
        job["prompt" if isinstance(prompt, str) else "prompt_token_ids"] = prompt
    return job, None


def _completion_prompt(prompt) -> tuple[str | list[int] | None, str | None]:
    """(A completion's one prompt: a string or token ids, also as OpenAI's list of one; or why not). A job, and
    so a batch line, takes one prompt; an online request of several is answered by `several_prompts`' jobs."""
    if isinstance(prompt, str) or is_token_ids(prompt):
        return prompt, None
    if isinstance(prompt, list) and len(prompt) == 1 and (isinstance(prompt[0], str) or is_token_ids(prompt[0])):
        return prompt[0], None
    if several_prompts(prompt):
        return None, (f"prompt holds {len(prompt)} prompts; a batch line takes one: give each a line of its own "
                      "(POST /v1/completions takes several)")
    return None, "a completion needs a prompt: a string or a list of token ids"


def several_prompts(prompt) -> bool:
    """Whether a completion's `prompt` is OpenAI's list of several prompts (strings or token-id lists)."""
    return (isinstance(prompt, list) and len(prompt) > 1
            and all(isinstance(p, str) or is_token_ids(p) for p in prompt))


def embedding_job(body: dict) -> tuple[dict, str | None]:
    """(The embedding job of an embeddings request body; or why it cannot run). The inputs' bounds are JobSpec's
    (`embed_inputs_error`), said here under the request's name for them."""
    unknown = sorted(set(body) - EMBEDDING_FIELDS - INFORMATIONAL)
    if unknown:
        return {}, f"unsupported body fields: {', '.join(u[:30] for u in unknown[:5])}"
    if body.get("encoding_format") not in (None, *ENCODING_FORMATS):
        return {}, f"encoding_format must be float or base64, got {_shown(body['encoding_format'])}"
    if "input" not in body:
        return {}, "an embedding needs input: a string, a list of strings, token ids or a list of token-id lists"
    inputs = embed_inputs(body["input"])
    error = embed_inputs_error(inputs)
    if error:
        return {}, f"input: {error}"
    job = {"embed": inputs, "stream": False}
    if body.get("dimensions") is not None:
        job["dimensions"] = body["dimensions"]
    return job, None


def _echo(url: str, value) -> tuple[bool, str | None]:
    """(Whether a completion echoes its prompt; or an error)."""
    if value is None or value is False:
        return False, None
    if value is not True:
        return False, f"echo must be true or false, got {_shown(value)}"
    if url != "/v1/completions":
        return False, "echo is a completions field (/v1/completions)"
    return True, None


def _response_format(value) -> tuple[dict | None, str | None]:
    """(The JSON schema that response_format asks for, None for plain text; or an error)."""
    if value is None:
        return None, None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None, None
    if kind == "json_object":
        return ANY_JSON_OBJECT, None
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
            return None, f"response_format.json_schema must be an object with a schema object, got {_shown(spec)}"
        return spec.get("schema", ANY_JSON_OBJECT), None  # OpenAI's schema is optional: any object then
    return None, (f"response_format must be {{\"type\": \"text\"}}, {{\"type\": \"json_object\"}} or {{\"type\": "
                  f"\"json_schema\", \"json_schema\": {{...}}}}, got {_shown(value)}")


def _logprobs(url: str, body: dict) -> tuple[int | None, str | None]:
    """(The wire's logprobs: how many top logprobs per token, None for none; or an error). Chat asks with
    logprobs=true and top_logprobs=N; a completion with logprobs=N."""
    asked, top = body.get("logprobs"), body.get("top_logprobs")
    if url == "/v1/completions":
        if top is not None:
            return None, "top_logprobs is a chat completions field; a completion asks with logprobs=N"
        if asked is None or isinstance(asked, bool) and not asked:
            return None, None
        if isinstance(asked, bool) or not isinstance(asked, int):
            return None, f"logprobs must be an integer (how many top logprobs per token), got {_shown(asked)}"
        return asked, None
    if asked is not None and not isinstance(asked, bool):
        return None, f"logprobs must be true or false, got {_shown(asked)}"
    if not asked:
        if top:
            return None, "top_logprobs needs logprobs=true"
        return None, None
    if top is None:
        return 0, None
    if isinstance(top, bool) or not isinstance(top, int):
        return None, f"top_logprobs must be an integer, got {_shown(top)}"
    return top, None


def output_line(line: BatchLine, request_id: str, result=None, error: str | None = None,
                model: str = "redline") -> dict:
    """The output line for one input line: its result, or an error."""
    out = {"id": f"batch_req_{request_id}", "custom_id": line.custom_id, "response": None, "error": None}
    error = error or line.error or (result.error if result is not None and not result.ok else None)
    if error is not None:
        out["error"] = {"code": getattr(result, "status", None) or "invalid_request", "message": error}
        return out
    body = response_body(line.url, result, line.with_logprobs, model, base64_vectors=line.base64)
    out["response"] = {"status_code": 200, "request_id": result.job_id, "body": body}
    return out


def response_body(url: str, result, with_logprobs: bool, model: str = "redline", prompt_only: bool = False,
                  base64_vectors: bool = False) -> dict:
    """A succeeded job's result as the endpoint's response: a chat.completion, a text_completion, or an
    embeddings list (base64_vectors: encoding_format base64). A completion whose result has prompt_logprobs
    (echo: true) starts with its prompt: its text and, with logprobs, its tokens (the first one's logprob
    null); prompt_only (echo with max_tokens 0): the prompt alone, its generated token left out."""
    if url == EMBEDDINGS:
        return embeddings_body(result, model, base64_vectors)
    chat = url == "/v1/chat/completions"
    echoed = None if chat else result.prompt_logprobs
    completions = result.outputs or [result]
    choices = []
    for i, c in enumerate(completions):
        entries, text, finish_reason = c.logprobs or [], c.text, c.finish_reason
        if prompt_only:
            entries, text, finish_reason = [], "", "length"
        if echoed is not None:
            entries = echoed + entries
            text = "".join(_token(e) for e in echoed) + text
        logprobs = None
        if with_logprobs:
            logprobs = _chat_logprobs(entries) if chat else _completion_logprobs(entries)
        if chat:
            choices.append({"index": i, "message": {"role": "assistant", "content": text},
                            "logprobs": logprobs, "finish_reason": finish_reason})
        else:
            choices.append({"index": i, "text": text, "logprobs": logprobs, "finish_reason": finish_reason})
    usage = usage_body(result)
    if prompt_only:
        usage.update(completion_tokens=0, total_tokens=usage["prompt_tokens"])
    return {"id": result.job_id, "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()), "model": model, "choices": choices, "usage": usage}


def embeddings_body(result, model: str, base64_vectors: bool = False) -> dict:
    """An embedding job's result as OpenAI's embeddings response."""
    def encoded(vector: list[float]):
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode() if base64_vectors else vector
    data = [{"object": "embedding", "index": i, "embedding": encoded(v)} for i, v in enumerate(result.embeddings)]
    tokens = result.usage.prompt_tokens
    return {"object": "list", "data": data, "model": model, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


def usage_body(result) -> dict:
    return {"prompt_tokens": result.usage.prompt_tokens, "completion_tokens": result.usage.completion_tokens,
            "total_tokens": result.usage.prompt_tokens + result.usage.completion_tokens}


def _token(entry: dict) -> str:
    token = entry.get("token")
    return token if token is not None else str(entry.get("token_id", ""))


def _chat_logprobs(entries: list | None) -> dict:
    """A chat choice's logprobs: {"content": [{token, logprob, bytes, top_logprobs: [...]}]}."""
    def one(token: str, logprob: float) -> dict:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}

    content = [{**one(_token(e), e["logprob"]),
                "top_logprobs": [one(_token(t), t["logprob"]) for t in e.get("top_logprobs", [])]}
               for e in entries or []]
    return {"content": content, "refusal": None}


def _completion_logprobs(entries: list | None) -> dict:
    """A completion choice's logprobs: {"tokens", "token_logprobs", "top_logprobs": [{token: logprob}],
    "text_offset"} (offsets into the choice's text). An echoed prompt's first token, which nothing scores,
    has a null logprob and null top logprobs."""
    entries = entries or []
    tokens = [_token(e) for e in entries]
    offsets, at = [], 0
    for token in tokens:
        offsets.append(at)
        at += len(token)
    return {"tokens": tokens, "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [None if e["logprob"] is None
                             else {_token(t): t["logprob"] for t in e.get("top_logprobs", [])} for e in entries],
            "text_offset": offsets}
