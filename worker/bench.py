"""`redline bench`: the engine alone (worker/bench_engine.py), or with `--through-queue` the same jobs end to end
(`--shared-prefixes`: cache-aware admission against arrival order, worker/bench_prefixes.py).

Through the queue, one process holds one engine and runs, after a warm-up:
  raw    llm.generate(workload)                              (the engine alone)
  queue  producer → Redis → worker → engine → Redis → producer (the same jobs, the same engine)
  celery (with --celery) the same jobs as Celery tasks: send_task → the same worker → .get(), from a producer
         process of its own (as a Celery service is)
and then measures the producer's pipelined submit rate. It prints one JSON line.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import threading
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path

CELERY_RESULT_TIMEOUT_S = 600  # --celery: the longest wait for one task's result before the run fails


def register(subparsers) -> None:
    # The real options come from worker.bench_engine, which imports torch: parse them in the handler, so that
    # building the `redline` parser for other subcommands stays light. '+' prefix: every arg is kept.
    parser = subparsers.add_parser("bench", help="throughput: the engine alone, or --through-queue end to end",
                                   add_help=False, prefix_chars="+")
    parser.add_argument("args", nargs=argparse.REMAINDER)
    parser.set_defaults(func=run_bench)


def build_parser() -> argparse.ArgumentParser:
    from worker import bench_engine as engine_bench

    from .cli import OneLineParser

    parser = OneLineParser(prog="redline bench", description=__doc__.splitlines()[0])
    engine_bench.add_arguments(parser)
    q = parser.add_argument_group("through the queue")
    q.add_argument("--through-queue", action="store_true",
                   help="also run the workload as jobs through Redis and the worker, and compare")
    q.add_argument("--redis-url", default=None, help="default: an embedded redis-server")
    q.add_argument("--stream", action="store_true", help="jobs ask for token deltas (default: results only)")
    q.add_argument("--submit-jobs", type=int, default=20_000, help="jobs for the submit-rate measurement")
    q.add_argument("--celery", action="store_true",
                   help="also run the jobs as Celery tasks (send_task, then .get()) through the same worker")
    q.add_argument("--shared-prefixes", action="store_true",
                   help="instead: 16 system prompts x 64 jobs through the queue, arrival order against "
                        "--cache-aware-admission (worker/bench_prefixes.py)")
    q.add_argument("--cache-aware-admission", action="store_true",
                   help="--through-queue: the worker reads ahead and the engine prefers cached prefixes (the "
                        "engine-alone run does not)")
    q.add_argument("--admission-max-wait", type=float, default=None,
                   help="--shared-prefixes: the cache-aware worker's --admission-max-wait [its default]")
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error")
    return parser


def run_bench(args: argparse.Namespace) -> int:
    from worker import bench_engine as engine_bench

    opts = build_parser().parse_args(args.args)
    args.debug = getattr(args, "debug", False) or opts.debug  # the top-level error handler reads it
    if getattr(opts, "embed", False) and (opts.through_queue or opts.shared_prefixes):
        raise ValueError("--embed measures the engine alone; leave out --through-queue and --shared-prefixes")
    if opts.shared_prefixes and (opts.through_queue or opts.celery or opts.cache_aware_admission):
        raise ValueError("--shared-prefixes runs its own jobs through the queue, both ways: leave out "
                         "--through-queue, --celery and --cache-aware-admission")
    if opts.admission_max_wait is not None and not opts.shared_prefixes:
        raise ValueError("--admission-max-wait applies to --shared-prefixes")
    if opts.celery and not opts.through_queue:
        raise ValueError("--celery compares Celery tasks with the queue's jobs: add --through-queue")
    if opts.cache_aware_admission and not opts.through_queue:
        raise ValueError("--cache-aware-admission applies to the queue's run: add --through-queue")
    if not (opts.through_queue or opts.shared_prefixes):
        engine_bench.run(opts)
        return 0
    engine_bench.check_arguments(opts)
    if opts.submit_jobs < 1:
        raise ValueError(f"--submit-jobs must be at least 1, got {opts.submit_jobs}")
    from producer.connection import check_server, connect
    from producer.embedded import RedisServer

    if opts.redis_url:
        args.redis_url = opts.redis_url  # the error handler names the Redis it could not reach
        check_server(connect(opts.redis_url), opts.redis_url)  # before the model loads
    server = None if opts.redis_url else RedisServer().start()
    try:
        if opts.shared_prefixes:
            from .bench_prefixes import run as run_shared_prefixes

            record = run_shared_prefixes(opts, opts.redis_url or server.url)
        else:
            record = run_through_queue(opts, opts.redis_url or server.url)
    finally:
        if server is not None:
            server.stop()
    print(json.dumps(record), flush=True)
    return 0


def sampling_dict(sp) -> dict:
    """A SamplingParams as the wire's sampling object (only the fields the wire knows, set ones)."""
    from producer.protocol import Sampling

    values = dataclasses.asdict(sp)
    return {k: v for k, v in values.items() if k in Sampling.model_fields and v not in (None, [])}


def forget_prefix_cache(llm) -> None:
    """Empty the prefix cache of an idle engine, so the second run of a workload gets no hits."""
    bm = llm.block_manager
    if bm.num_free_blocks != bm.num_blocks:
        raise RuntimeError("the engine still holds KV blocks")
    bm.hash_to_block_id.clear()
    for block in bm.blocks:
        block.hash, block.token_ids = -1, []


def run_through_queue(opts: argparse.Namespace, url: str) -> dict:
    from worker import bench_engine as engine_bench

    prompts, params = engine_bench.make_workload(opts)
    llm = engine_bench.build_llm(opts)
    engine_bench.warm_up(llm, opts)

    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    raw_s = time.perf_counter() - start
    raw_tokens = sum(len(o.token_ids) for o in outputs)
    print(f"engine alone:      {raw_tokens} tokens in {raw_s:.2f} s = {raw_tokens / raw_s:,.0f} tok/s", flush=True)
    forget_prefix_cache(llm)

    jobs = [{"prompt_token_ids": prompt, "sampling": sampling_dict(sp), "stream": opts.stream}
            for prompt, sp in zip(prompts, params)]
    llm.scheduler.prefer_cached = opts.cache_aware_admission
    queue_s, queue_tokens = through_queue(llm, url, jobs, opts,
                                          worker_settings={"cache_aware_admission": opts.cache_aware_admission})
    ratio = (queue_tokens / queue_s) / (raw_tokens / raw_s)
    print(f"through the queue: {queue_tokens} tokens in {queue_s:.2f} s = {queue_tokens / queue_s:,.0f} tok/s "
          f"({ratio:.3f} of the engine alone)", flush=True)
    celery = {}
    if opts.celery:
        forget_prefix_cache(llm)
        celery_s, celery_tokens = through_queue(llm, url, jobs, opts, celery=True)
        celery_ratio = (celery_tokens / celery_s) / (raw_tokens / raw_s)
        print(f"through Celery:    {celery_tokens} tokens in {celery_s:.2f} s = {celery_tokens / celery_s:,.0f} tok/s "
              f"({celery_ratio:.3f} of the engine alone)", flush=True)
        celery = {"celery_tokens": celery_tokens, "celery_seconds": round(celery_s, 3),
                  "celery_tok_s": round(celery_tokens / celery_s, 1), "celery_vs_raw": round(celery_ratio, 4)}

    submit_s = measure_submit_rate(url, opts.submit_jobs)
    print(f"producer submit:   {opts.submit_jobs} jobs in {submit_s:.2f} s = {opts.submit_jobs / submit_s:,.0f} jobs/s",
          flush=True)
    return {
        "gpu": engine_bench.gpu_name(), "commit": engine_bench.git_commit(opts.commit),
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
        "model": Path(engine_bench.resolve_model(opts.model)).name,
        "num_seqs": opts.num_seqs, "stream": opts.stream, "cache_aware_admission": opts.cache_aware_admission,
        "raw_tokens": raw_tokens, "raw_seconds": round(raw_s, 3), "raw_tok_s": round(raw_tokens / raw_s, 1),
        "queue_tokens": queue_tokens, "queue_seconds": round(queue_s, 3),
        "queue_tok_s": round(queue_tokens / queue_s, 1), "queue_vs_raw": round(ratio, 4), **celery,
        "submit_jobs": opts.submit_jobs, "submit_seconds": round(submit_s, 3),
        "submit_jobs_per_s": round(opts.submit_jobs / submit_s, 1),
    }


def through_queue(llm, url: str, jobs: list[dict], opts, celery: bool = False, producer=None,
                  worker_settings: dict | None = None) -> tuple[float, int]:
    """Run a worker on this thread (where the engine was built) and a producer beside it (redline's Client,
    or with `celery` a Celery app's send_task, or `producer(url, queue)`'s function of a list of jobs that
    returns their results); time from the first submit to the last result read back. `worker_settings`: more
    of the worker's settings."""
    from producer.connection import connect

    from .loop import Worker
    from .settings import WorkerSettings

    queue = f"bench-{uuid.uuid4().hex[:8]}"
    settings = WorkerSettings(model=str(opts.model), redis_url=url, queue=queue, worker_name="bench-worker",
                              celery_queue=queue if celery else None, **(worker_settings or {}))
    worker = Worker(settings, llm, connect(url))
    run_jobs = (producer or (_celery_producer if celery else _redline_producer))(url, queue)
    outcome: dict = {}

    def produce() -> None:
        try:
            worker.ready.wait()
            warm = [{"prompt_token_ids": job["prompt_token_ids"][:32],
                     "sampling": {**job["sampling"], "max_tokens": 8}} for job in jobs[:8]]
            run_jobs(warm)
            start = time.perf_counter()
            results = run_jobs(jobs)
            outcome["seconds"] = time.perf_counter() - start
            outcome["tokens"] = sum(r.usage.completion_tokens for r in results)
            bad = [r for r in results if not r.ok]
            if bad:
                outcome["error"] = f"{len(bad)} jobs did not succeed, e.g. {bad[0].error}"
        except Exception as e:  # reported after the worker stops
            outcome["error"] = f"{type(e).__name__}: {e}"
        finally:
            worker.stop()

    producer = threading.Thread(target=produce, name="bench-producer")
    producer.start()
    try:
        worker.run()
        producer.join()
    finally:
        getattr(run_jobs, "close", lambda: None)()
    if "error" in outcome:
        raise RuntimeError(f"through-queue run failed: {outcome['error']}")
    return outcome["seconds"], outcome["tokens"]


def _redline_producer(url: str, queue: str):
    """Submit jobs with one pipelined submit_many and read their results as the feed announces them."""
    from producer import Client

    client = Client(url, queue)
    return lambda jobs: collect(client, client.submit_many(jobs))


def in_own_process(round_fn, *args, processes: int = 1):
    """`through_queue`'s producer whose rounds run round_fn(*args, jobs) in a process of its own, as a producing
    service is one: in the engine's process its Python work would take the engine's GIL. With `processes`
    several, each takes every processes-th job, as several producing services would. `.close()` ends them."""
    import multiprocessing

    pool = multiprocessing.get_context("spawn").Pool(processes)

    def run(jobs: list[dict]) -> list:
        parts = pool.starmap(_round, [(round_fn, args, jobs[i::processes]) for i in range(processes)])
        results: list = [None] * len(jobs)
        for i, part in enumerate(parts):
            results[i::processes] = part
        return results
    run.close = pool.terminate
    return run


def _round(round_fn, args: tuple, jobs: list[dict]) -> list:
    """In the producer process: one round. A failure comes back as a RuntimeError with its message (a client
    library's own exceptions do not always survive the trip between processes)."""
    try:
        return round_fn(*args, jobs)
    except Exception as e:  # noqa: BLE001 - reported whole in the bench's process
        raise RuntimeError(f"{type(e).__name__}: {e}") from None


def _celery_producer(url: str, queue: str):
    """Send jobs as a Celery producer does (send_task, one message each) and read each result with .get()."""
    return in_own_process(_celery_round, url, queue)


_CELERY_APPS: dict = {}


def _celery_round(url: str, queue: str, jobs: list[dict]) -> list:
    """In the producer process: send every job, then .get() each result."""
    from celery import Celery

    from producer.protocol import JobResult

    from .celery_source import TASK_NAME

    app = _CELERY_APPS.get(url) or _CELERY_APPS.setdefault(url, Celery(broker=url, backend=url, set_as_current=False))
    sent = [app.send_task(TASK_NAME, kwargs={k: v for k, v in job.items() if k != "stream"}, queue=queue)
            for job in jobs]
    return [JobResult.model_validate(r.get(timeout=CELERY_RESULT_TIMEOUT_S)) for r in sent]


def collect(client, ids: list[str]) -> list:
    """Read results as the feed announces them (one blocking read for many jobs), in `ids` order."""
    from producer.protocol import JobResult

    wanted, results = set(ids), {}
    last = "0-0"
    while wanted:
        reply = client.redis.xread({client.keys.results: last}, count=1000, block=60_000)
        if not reply:
            raise TimeoutError(f"no results for 60 s; {len(wanted)} jobs outstanding")
        done = []
        for entry_id, fields in reply[0][1]:
            last = entry_id
            job_id = fields[b"job_id"].decode()
            if job_id in wanted:
                wanted.discard(job_id)
                done.append(job_id)
        if done:
            pipe = client.redis.pipeline(transaction=False)
            for job_id in done:
                pipe.hget(client.keys.job(job_id), "result")
            for job_id, raw in zip(done, pipe.execute()):
                results[job_id] = JobResult.model_validate_json(raw)
    return [results[i] for i in ids]


def measure_submit_rate(url: str, n: int) -> float:
    """Seconds for one pipelined submit_many of `n` small text jobs (into a queue no worker reads)."""
    from producer import Client

    client = Client(url, f"submit-rate-{uuid.uuid4().hex[:8]}")
    jobs = [{"prompt": f"Summarize support ticket #{i} in one sentence.", "sampling": {"max_tokens": 64}}
            for i in range(n)]
    start = time.perf_counter()
    ids = client.submit_many(jobs)
    seconds = time.perf_counter() - start
    pipe = client.redis.pipeline(transaction=False)
    for i in range(0, len(ids), 1000):
        pipe.delete(*[client.keys.job(j) for j in ids[i:i + 1000]])
    pipe.delete(*client.keys.all_jobs())
    pipe.execute()
    return seconds


if __name__ == "__main__":
    sys.exit(run_bench(argparse.Namespace(args=sys.argv[1:])))
