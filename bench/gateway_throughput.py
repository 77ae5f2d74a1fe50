"""Throughput through the HTTP gateway against the engine alone: nano-vllm's bench workload as concurrent
/v1/completions calls. Reproduces docs/performance.md's "through the gateway" row:

    python3 bench/gateway_throughput.py            # one GPU: the Qwen3-0.6B shape, 256 sequences, 256 calls at once
    python3 bench/gateway_throughput.py --model tiny --num-seqs 8 --device cpu   # anywhere, to try it

One process holds one engine (a worker on this thread, as `redline bench --through-queue` runs it) and runs,
after a warm-up: the workload through `llm.generate` (raw), then as jobs through the queue (queue), then as
HTTP calls of the official `openai` client (AsyncOpenAI, `--concurrency` at once, from `--clients` processes of
their own: the client takes ~7 ms of Python to build a call with a prompt of a few hundred token ids, so one
process alone would spend ~2 s issuing 256) to a `redline serve` process that puts them on the same queue (gateway). Each call asks for its prompt's token ids, max_tokens,
temperature and ignore_eos, so all three runs generate the same tokens. Needs `openai` (the dev extra).
Prints one JSON line; gateway_vs_raw is gateway tok/s over raw tok/s.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
import urllib.request
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from producer.embedded import RedisServer, free_port  # noqa: E402
from producer.protocol import JobResult, Usage  # noqa: E402
from worker import bench_engine as engine_bench  # noqa: E402
from worker.bench import forget_prefix_cache, in_own_process, sampling_dict, through_queue  # noqa: E402

GATEWAY_START_S = 60  # the longest wait for `redline serve` to answer


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    engine_bench.add_arguments(parser)
    parser.add_argument("--concurrency", type=int, default=256, help="HTTP calls in flight at once, in all")
    parser.add_argument("--clients", type=int, default=None,
                        help="client processes the calls are spread over (default: 8, at most --concurrency)")
    parser.add_argument("--redis-url", default=None, help="default: an embedded redis-server")
    return parser


def start_gateway(url: str, queue: str) -> tuple[subprocess.Popen, int]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "worker.cli", "serve", "--redis-url", url, "--queue", queue,
                             "--port", str(port), "--log-level", "WARNING"], cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(
                                filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))})
    deadline = time.monotonic() + GATEWAY_START_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"redline serve exited {proc.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1):
                return proc, port
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"redline serve did not answer within {GATEWAY_START_S} s")


def http_producer(concurrency: int, clients: int, started: list):
    """`through_queue`'s producer: a gateway for the queue, and the jobs sent to it as concurrent HTTP calls
    from `clients` client processes of their own, concurrency / clients at once each."""
    def make(url: str, queue: str):
        proc, port = start_gateway(url, queue)
        started.append(proc)
        return in_own_process(_send_all, port, -(-concurrency // clients), processes=clients)
    return make


def _send_all(port: int, concurrency: int, jobs: list[dict]) -> list[JobResult]:
    """In the client process: every job as an HTTP call, `concurrency` at once."""
    return asyncio.run(_send(port, jobs, concurrency))


async def _send(port: int, jobs: list[dict], concurrency: int) -> list[JobResult]:
    import openai

    client = openai.AsyncOpenAI(api_key="bench", base_url=f"http://127.0.0.1:{port}/v1", max_retries=0,
                                timeout=3600)
    slots = asyncio.Semaphore(concurrency)

    async def one(job: dict) -> JobResult:
        body = dict(job["sampling"])
        schema = body.pop("json_schema", None)
        if schema is not None:
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": "bench", "schema": schema}}
        async with slots:
            out = await client.completions.create(model="bench", prompt=job["prompt_token_ids"], extra_body=body)
        return JobResult(job_id=out.id, status="succeeded", usage=Usage(prompt_tokens=out.usage.prompt_tokens,
                                                                        completion_tokens=out.usage.completion_tokens))
    try:
        return await asyncio.gather(*(one(job) for job in jobs))
    finally:
        await client.close()


def main() -> int:
    opts = build_parser().parse_args()
    engine_bench.check_arguments(opts)
    if opts.concurrency < 1:
        raise SystemExit(f"--concurrency must be at least 1, got {opts.concurrency}")
    opts.clients = opts.clients or min(8, opts.concurrency)
    if not 1 <= opts.clients <= opts.concurrency:
        raise SystemExit(f"--clients must be between 1 and --concurrency ({opts.concurrency}), got {opts.clients}")
    server = None if opts.redis_url else RedisServer().start()
    url = opts.redis_url or server.url
    gateways: list[subprocess.Popen] = []
    try:
        prompts, params = engine_bench.make_workload(opts)
        llm = engine_bench.build_llm(opts)
        engine_bench.warm_up(llm, opts)
        start = time.perf_counter()
        raw_tokens = sum(len(o.token_ids) for o in llm.generate(prompts, params, use_tqdm=False))
        raw_s = time.perf_counter() - start
        jobs = [{"prompt_token_ids": prompt, "sampling": sampling_dict(sp), "stream": False}
                for prompt, sp in zip(prompts, params)]
        figures = {"raw": (raw_s, raw_tokens)}
        for name, producer in (("queue", None), ("gateway", http_producer(opts.concurrency, opts.clients, gateways))):
            forget_prefix_cache(llm)
            figures[name] = through_queue(llm, url, jobs, opts, producer=producer)
        llm.shutdown()
    finally:
        for proc in gateways:
            proc.terminate()
            proc.wait(30)
        if server is not None:
            server.stop()
    record = {"gpu": engine_bench.gpu_name(), "commit": engine_bench.git_commit(opts.commit),
              "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
              "model": Path(engine_bench.resolve_model(opts.model)).name, "num_seqs": opts.num_seqs,
              "concurrency": opts.concurrency, "clients": opts.clients}
    for name, (seconds, tokens) in figures.items():
        record.update({f"{name}_tokens": tokens, f"{name}_seconds": round(seconds, 3),
                       f"{name}_tok_s": round(tokens / seconds, 1)})
        print(f"{name:8s} {tokens} tokens in {seconds:.2f} s = {tokens / seconds:,.0f} tok/s", file=sys.stderr)
    for name in ("queue", "gateway"):
        record[f"{name}_vs_raw"] = round(record[f"{name}_tok_s"] / record["raw_tok_s"], 4)
    print(json.dumps(record), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
