"""Batches (`/v1/batches`): an uploaded JSONL file's lines as jobs on the queue, and their output files.

A batch lives in Redis, never in a gateway: its hash (`Keys.batch`) holds the request, a summary of each
line and the status; line i is job `<batch id>-<i>`, parsed and validated by `producer.batch_format`, the
mapping `redline batch` uses. Any gateway answers for any batch by reading its jobs' statuses, and every
gateway advances the open ones (`Keys.open_batches`) in the background: a batch whose jobs are all final is
finalized once, writing its output and error files under ids derived from the batch id, so two gateways
finalizing together write the same files. A gateway restart loses nothing.

Statuses, as OpenAI's: validating (its jobs are being submitted) → in_progress → finalizing → completed;
failed (the input is not JSONL); cancelling → cancelled (`cancel`, unfinished jobs are cancelled); and
expired: `completion_window` is every job's deadline, and when it passes the unfinished jobs are cancelled.
"""
from __future__ import annotations

import asyncio
import collections
import json
import logging
import re
import time
import uuid

from .. import protocol as p
from ..batch import SUBMIT_CHUNK, Batch, BatchError, input_lines
from ..batch_format import ENDPOINTS, BatchLine, output_line
from ..client import build_job, cancel_call, submit_call
from ..scripts import ScriptSet
from .errors import APIError, invalid, not_found
from .files import FileStore, page
from .offload import Offload

log = logging.getLogger("redline.gateway")

KEEPER_INTERVAL_S = 1.0  # how often every gateway advances the open batches
STALE_S = 60.0  # a batch validating or finalizing this long lost its gateway: another one takes over
READ_CHUNK = 1000  # job statuses and results read per pipeline
WINDOW_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
FINAL = ("completed", "failed", "expired", "cancelled")
MAX_METADATA_PAIRS = 16
# the hash's fields a status answer reads (`lines`, the large one, is read only to finalize)
FIELDS = ("batch", "status", "total", "errors", "output_file_id", "error_file_id", "validating_at", "submitted_at",
          "in_progress_at", "cancelling_at", "finalizing_at", "completed_at", "failed_at", "expired_at",
          "cancelled_at", "scanned", "scanned_completed", "scanned_failed", "completed", "failed")
TIMES = ("in_progress_at", "cancelling_at", "finalizing_at", "completed_at", "failed_at", "expired_at",
         "cancelled_at")

# KEYS: batch hash. ARGV: new status, the statuses it may move from (space-separated), then field-value pairs.
# Returns 1 if moved, 0 if the batch is in another status, -1 if there is no such batch.
TRANSITION = """
local current = redis.call('HGET', KEYS[1], 'status')
if not current then return -1 end
if not string.find(' ' .. ARGV[2] .. ' ', ' ' .. current .. ' ', 1, true) then return 0 end
redis.call('HSET', KEYS[1], 'status', ARGV[1], unpack(ARGV, 3))
return 1
"""


class GatewayScripts(ScriptSet):
    SOURCES = {"transition": TRANSITION}


def parse_window(value) -> int:
    """A completion_window ("24h", "90m", ...) in seconds."""
    match = re.fullmatch(r"(\d{1,7})([smhd])", value) if isinstance(value, str) else None
    if not match or int(match.group(1)) == 0:
        raise invalid(f"completion_window must be a duration such as \"24h\" (units s, m, h, d), got {value!r}",
                      "completion_window")
    return int(match.group(1)) * WINDOW_UNITS[match.group(2)]


def check_metadata(metadata) -> dict | None:
    if metadata is None:
        return None
    if not isinstance(metadata, dict) or len(metadata) > MAX_METADATA_PAIRS or not all(
            isinstance(k, str) and len(k) <= 64 and isinstance(v, str) and len(v) <= 512 for k, v in metadata.items()):
        raise invalid("metadata must be an object of at most 16 string pairs (keys up to 64 characters, values "
                      "up to 512)", "metadata")
    return metadata


def prepare(lines: list[str], batch_id: str, endpoint: str, window_s: int,
            adapters: tuple[str, ...] = ()) -> tuple[Batch, list[tuple]]:
    """The batch's lines, parsed, and the validated jobs (`build_job`'s) of those that can run (the others'
    lines say why). adapters: the LoRA adapter names a line's `model` may give."""
    batch = Batch.from_lines(lines, batch_id, endpoint, adapters)
    jobs = []
    for line, job_id in zip(batch.lines, batch.line_ids):
        if line.error is None:
            try:
                jobs.append(build_job(**line.job, job_id=job_id, deadline_s=window_s))
            except ValueError as e:
                line.error = str(e)
    return batch, jobs


class BatchStore:
    """The batches of one queue: created from files, advanced and finalized by every gateway."""

    def __init__(self, client, files: FileStore, model_name: str, metrics, offload: Offload,
                 adapters: tuple[str, ...] = ()) -> None:
        self.client, self.files, self.model_name = client, files, model_name
        self.adapters = adapters  # LoRA adapter names a line's model may give
        self.metrics, self.offload = metrics, offload
        self.redis, self.keys = client.redis, client.keys
        self.scripts = GatewayScripts(self.redis)

    async def _move(self, batch_id: str, status: str, allowed: str, **fields) -> int:
        pairs = [x for kv in fields.items() for x in kv]
        return int(await self.scripts.transition(keys=[self.keys.batch(batch_id)], args=[status, allowed, *pairs]))

    # ---- create ----

    async def create(self, body: dict) -> dict:
        unknown = sorted(set(body) - {"input_file_id", "endpoint", "completion_window", "metadata"})
        if unknown:
            raise invalid(f"unsupported fields: {', '.join(u[:40] for u in unknown[:5])}", unknown[0][:40])
        endpoint = body.get("endpoint")
        if endpoint not in ENDPOINTS:
            raise invalid(f"endpoint must be one of {', '.join(ENDPOINTS)}, got {str(endpoint)[:80]!r}", "endpoint")
        window_s = parse_window(body.get("completion_window"))
        metadata = check_metadata(body.get("metadata"))
        file_id = body.get("input_file_id")
        if not isinstance(file_id, str):
            raise invalid("input_file_id must be the id of an uploaded file", "input_file_id")
        meta = await self.files.get(file_id)
        if meta["purpose"] != "batch":
            raise invalid(f"file {file_id} has purpose {meta['purpose']!r}; a batch reads a file of purpose 'batch'",
                          "input_file_id")
        batch_id, now = f"batch_{uuid.uuid4().hex}", int(time.time())
        request = {"id": batch_id, "object": "batch", "endpoint": endpoint, "input_file_id": file_id,
                   "completion_window": body["completion_window"], "created_at": now, "expires_at": now + window_s,
                   "metadata": metadata, "model": self.model_name}
        fields = {"batch": json.dumps(request), "status": "validating", "validating_at": now}
        try:
            lines = await self.offload(input_lines, await self.files.content(file_id), f"file {file_id}")
        except BatchError as e:
            errors = {"object": "list", "data": [{"code": "invalid_file", "message": str(e), "param": "input_file_id",
                                                  "line": None}]}
            fields.update(status="failed", failed_at=now, errors=json.dumps(errors), total=0)
            lines = None
        pipe = self.redis.pipeline(transaction=False)
        pipe.hset(self.keys.batch(batch_id), mapping=fields)
        pipe.zadd(self.keys.batches, {batch_id: int(time.time() * 1000)})
        if lines is not None:
            pipe.sadd(self.keys.open_batches, batch_id)
        await pipe.execute()
        if lines is None:
            self.metrics.batch_finished("failed")
        else:
            await self._submit(batch_id, request, lines)
        return await self.advance(batch_id)

    async def _submit(self, batch_id: str, request: dict, lines: list[str]) -> None:
        """Submit the batch's jobs (again, after a gateway died: ids that exist are not enqueued twice)."""
        window_s = request["expires_at"] - request["created_at"]
        try:
            batch, jobs = await self.offload(prepare, lines, batch_id, request["endpoint"], window_s,
                                             self.adapters)
        except Exception as e:  # noqa: BLE001 - an input no line check foresaw fails its batch, never loops it
            log.exception("batch %s: its input could not be prepared", batch_id)
            return await self._fail(batch_id, f"the input could not be prepared: {type(e).__name__}: {str(e)[:200]}")
        summaries = [[line.custom_id, line.url, line.error, line.with_logprobs, line.base64] for line in batch.lines]
        await self.redis.hset(self.keys.batch(batch_id), mapping={"lines": json.dumps(summaries),
                                                                  "total": len(lines)})
        for start in range(0, len(jobs), SUBMIT_CHUNK):
            keys, args = submit_call(self.keys, jobs[start:start + SUBMIT_CHUNK])
            await self.client.scripts.submit(keys=keys, args=args)
        await self.redis.hset(self.keys.batch(batch_id), "submitted_at", int(time.time()))
        if await self._move(batch_id, "in_progress", "validating", in_progress_at=int(time.time())) == 0:
            await self._cancel_unfinished(batch_id)  # cancelled while its jobs were being submitted

    async def _resubmit(self, batch_id: str, request: dict) -> None:
        await self.redis.hset(self.keys.batch(batch_id), "validating_at", int(time.time()))  # the others wait
        try:
            content = await self.files.content(request["input_file_id"])
        except APIError:
            return await self._fail(batch_id, "the input file was deleted before the batch's jobs were all submitted")
        await self._submit(batch_id, request, await self.offload(input_lines, content, "the input file"))

    async def _fail(self, batch_id: str, message: str) -> None:
        """A validating batch whose jobs cannot be submitted is failed, with `message` as its error."""
        errors = {"object": "list", "data": [{"code": "invalid_file", "param": "input_file_id", "line": None,
                                              "message": message}]}
        if await self._move(batch_id, "failed", "validating cancelling", failed_at=int(time.time()),
                            errors=json.dumps(errors)) == 1:
            self.metrics.batch_finished("failed")
        await self.redis.srem(self.keys.open_batches, batch_id)

    # ---- progress ----

    async def _hash(self, batch_id: str) -> dict:
        values = await self.redis.hmget(self.keys.batch(batch_id), FIELDS)
        if values[0] is None:
            raise not_found("batch", batch_id)
        return {k: p.decode(v) for k, v in zip(FIELDS, values) if v is not None}

    async def _scan(self, batch_id: str, h: dict) -> tuple[int, int, list[str]]:
        """(completed, failed, ids of unfinished jobs): lines whose job succeeded, whose job ended otherwise or
        never ran, and the rest. Lines before `scanned` are known final, and their tallies are kept."""
        total, scanned = int(h.get("total", 0)), int(h.get("scanned", 0))
        completed, failed = int(h.get("scanned_completed", 0)), int(h.get("scanned_failed", 0))
        unfinished: list[str] = []
        prefix = (scanned, completed, failed)
        for start in range(scanned, total, READ_CHUNK):
            ids = [f"{batch_id}-{i}" for i in range(start, min(start + READ_CHUNK, total))]
            pipe = self.redis.pipeline(transaction=False)
            for job_id in ids:
                pipe.hget(self.keys.job(job_id), "status")
            for job_id, status in zip(ids, await pipe.execute()):
                status = p.decode(status) if status is not None else None
                if status in (p.QUEUED, p.RUNNING):
                    unfinished.append(job_id)
                    continue
                completed += status == p.SUCCEEDED
                failed += status != p.SUCCEEDED  # a line that never became a job too
                if not unfinished:
                    prefix = (prefix[0] + 1, completed, failed)
        # consistent whoever writes it (final statuses stay final), once every job has been submitted
        if prefix[0] > scanned and "submitted_at" in h:
            await self.redis.hset(self.keys.batch(batch_id), mapping=dict(zip(
                ("scanned", "scanned_completed", "scanned_failed"), prefix)))
        return completed, failed, unfinished

    async def advance(self, batch_id: str) -> dict:
        """Move the batch on as far as its jobs allow (submit, expire, finalize); return its OpenAI object."""
        h = await self._hash(batch_id)
        status, request, now = h["status"], json.loads(h["batch"]), time.time()
        if "submitted_at" not in h and status in ("validating", "cancelling"):
            if now - float(h["validating_at"]) > STALE_S:  # its gateway stopped while submitting it
                await self._resubmit(batch_id, request)
                h = await self._hash(batch_id)
            if "submitted_at" not in h:
                return self._view(h, None)
        elif status == "finalizing" and now - float(h["finalizing_at"]) > STALE_S:
            await self._finalize(batch_id, h, "finalizing")
            h = await self._hash(batch_id)
        if h["status"] not in ("in_progress", "cancelling"):
            return self._view(h, None)
        counts = await self._scan(batch_id, h)
        if counts[2] and h["status"] == "in_progress" and now >= request["expires_at"]:
            if await self._move(batch_id, "cancelling", "in_progress", expired_at=int(now)) == 1:
                await self._cancel(counts[2])
            h = await self._hash(batch_id)
        if not counts[2]:
            await self._finalize(batch_id, h, "in_progress cancelling")
            h = await self._hash(batch_id)
            if h["status"] in FINAL:
                counts = None
        return self._view(h, counts)

    def _view(self, h: dict, counts: tuple | None) -> dict:
        """The OpenAI batch object."""
        view = json.loads(h["batch"])
        shown = h["status"]
        if shown == "cancelling" and "cancelling_at" not in h:
            shown = "in_progress"  # its window ended: its unfinished jobs are being cancelled, then it expires
        if counts is None:
            completed, failed = int(h.get("completed", h.get("scanned_completed", 0))), \
                int(h.get("failed", h.get("scanned_failed", 0)))
        else:
            completed, failed = counts[0], counts[1]
        view.update(status=shown, output_file_id=h.get("output_file_id"), error_file_id=h.get("error_file_id"),
                    errors=json.loads(h["errors"]) if "errors" in h else None,
                    request_counts={"total": int(h.get("total", 0)), "completed": completed, "failed": failed},
                    **{t: int(float(h[t])) if t in h else None for t in TIMES})
        if shown == "in_progress" and "expired_at" in h:
            view["expired_at"] = None
        return view

    # ---- cancel ----

    async def cancel(self, batch_id: str) -> dict:
        moved = await self._move(batch_id, "cancelling", "validating in_progress", cancelling_at=int(time.time()))
        if moved == -1:
            raise not_found("batch", batch_id)
        if moved == 0:
            h = await self._hash(batch_id)
            if h["status"] != "cancelling":
                raise APIError(409, f"batch {batch_id} is {h['status']}: only a validating or in_progress batch "
                                    "can be cancelled")
        await self._cancel_unfinished(batch_id)
        return await self.advance(batch_id)

    async def _cancel_unfinished(self, batch_id: str) -> None:
        await self._cancel((await self._scan(batch_id, await self._hash(batch_id)))[2])

    async def _cancel(self, job_ids: list[str]) -> None:
        for start in range(0, len(job_ids), READ_CHUNK):
            pipe = self.redis.pipeline(transaction=False)
            for job_id in job_ids[start:start + READ_CHUNK]:
                keys, args = cancel_call(self.keys, job_id)
                await self.client.scripts.cancel(keys=keys, args=args, client=pipe)
            await pipe.execute()

    # ---- finalize ----

    async def _finalize(self, batch_id: str, h: dict, allowed: str) -> None:
        """Write the output and error files of a batch whose jobs are all final, then its final status."""
        if await self._move(batch_id, "finalizing", allowed, finalizing_at=int(time.time())) != 1:
            return  # another gateway finalizes it, or it is final already
        summaries = json.loads(await self.redis.hget(self.keys.batch(batch_id), "lines") or "[]")
        results: list = []
        for start in range(0, len(summaries), READ_CHUNK):
            pipe = self.redis.pipeline(transaction=False)
            for i in range(start, min(start + READ_CHUNK, len(summaries))):
                pipe.hget(self.keys.job(f"{batch_id}-{i}"), "result")
            results += await pipe.execute()
        expired = "expired_at" in h
        outputs, errors, any_expired = await self.offload(self._output_rows, batch_id, summaries, results, expired)
        hex_id = batch_id.removeprefix("batch_")
        files = {}
        if outputs:
            files["output_file_id"] = (await self.files.put(f"file-{hex_id}-output", f"{batch_id}_output.jsonl",
                                                            "batch_output", outputs))["id"]
        if errors:
            files["error_file_id"] = (await self.files.put(f"file-{hex_id}-errors", f"{batch_id}_errors.jsonl",
                                                           "batch_output", errors))["id"]
        final = "cancelled" if "cancelling_at" in h else "expired" if expired or any_expired else "completed"
        n_out, n_err = outputs.count(b"\n"), errors.count(b"\n")
        if await self._move(batch_id, final, "finalizing", completed=n_out, failed=n_err,
                            **{f"{final}_at": int(time.time())}, **files) == 1:
            self.metrics.batch_finished(final)
        await self.redis.srem(self.keys.open_batches, batch_id)
        log.info("batch %s %s: %d succeeded, %d failed", batch_id, final, n_out, n_err)

    def _output_rows(self, batch_id: str, summaries: list, results: list, expired: bool) -> tuple[bytes, bytes, bool]:
        """(The output file, the error file, whether a job expired): one line per input line, in order."""
        outputs, errors, any_expired = [], [], False
        for i, ((custom_id, url, error, with_logprobs, *rest), raw) in enumerate(zip(summaries, results)):
            # rest: base64 (a batch summarised before embeddings has none)
            line = BatchLine(custom_id, url, error=error, with_logprobs=with_logprobs, base64=bool(rest and rest[0]))
            result = p.JobResult.model_validate_json(raw) if raw and error is None else None
            lost = "its job's result expired or was lost" if result is None and error is None else None
            row = output_line(line, f"{batch_id}-{i}", result, lost, self.model_name)
            ran_out = result is not None and (result.status == p.EXPIRED or expired and result.status == p.CANCELLED)
            if ran_out:  # not started within the window, or cancelled when it ended
                any_expired = True
                row["error"] = {"code": "batch_expired", "message": "the batch's completion window ended before this "
                                                                    "request finished"}
            (outputs if row["error"] is None else errors).append(json.dumps(row) + "\n")
        return "".join(outputs).encode(), "".join(errors).encode(), any_expired

    # ---- list and keep ----

    async def list(self, limit: int, after: str | None) -> dict:
        async def fetch(ids: list[str]) -> list[dict | None]:
            out = []
            for batch_id in ids:
                try:
                    out.append(await self.advance(batch_id))
                except APIError:
                    out.append(None)
            return out

        return await page(self.redis, self.keys.batches, fetch, limit, after)

    async def keep(self) -> None:
        """Advance every open batch, every KEEPER_INTERVAL_S, until cancelled (each gateway runs this)."""
        while True:
            try:
                statuses = collections.Counter()
                for batch_id in await self.redis.smembers(self.keys.open_batches):
                    try:
                        statuses[(await self.advance(p.decode(batch_id)))["status"]] += 1
                    except APIError:  # deleted under us
                        await self.redis.srem(self.keys.open_batches, batch_id)
                self.metrics.set_open_batches(statuses)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # Redis away for a moment: the next round tries again
                log.warning("advancing batches failed: %s", str(e)[:300] or type(e).__name__)
            await asyncio.sleep(KEEPER_INTERVAL_S)
