"""`redline demo`: the whole path on this machine, with nothing installed beyond the package.

An embedded redis-server, a worker on its own thread, a producer submitting a few jobs (text, chat and
token ids), one completion streamed as it is generated, every result printed, and the throughput.
"""
from __future__ import annotations

import argparse
import logging
import time

PROMPTS = ["The quickest way to learn a language is", "Redis streams are useful because",
           "Once upon a time, in a small town,", "The three laws of thermodynamics say"]


def register(subparsers) -> None:
    parser = subparsers.add_parser("demo", help="embedded Redis + worker + a few jobs, end to end")
    parser.add_argument("--model", default=None,
                        help="HF hub id, local directory or built-in name; default: tiny (the built-in model, "
                             "random weights)")
    parser.add_argument("--load-format", default=None,
                        help="auto | dummy (default: auto; dummy for the built-in model)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--num-jobs", type=positive_int, default=12)
    parser.add_argument("--max-tokens", type=positive_int, default=32)
    parser.add_argument("--redis-url", default=None,
                        help="default: start an embedded redis-server that keeps nothing after the demo")
    parser.set_defaults(func=run_demo)


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _jobs(n: int, max_tokens: int) -> list[dict]:
    sampling = {"temperature": 0.8, "top_p": 0.95, "max_tokens": max_tokens, "seed": 0}
    jobs = []
    for i in range(n):
        prompt = PROMPTS[i % len(PROMPTS)]
        if i % 3 == 0:
            job = {"prompt": prompt}
        elif i % 3 == 1:
            job = {"messages": [{"role": "user", "content": prompt}]}
        else:
            job = {"prompt_token_ids": [(7 * i + k) % 200 + 10 for k in range(8)]}
        jobs.append({**job, "sampling": {**sampling, "seed": i}})
    return jobs


def _describe(job: dict) -> str:
    if "prompt" in job:
        return f"text  {job['prompt']!r}"
    if "messages" in job:
        return f"chat  {job['messages'][0]['content']!r}"
    return f"ids   {job['prompt_token_ids']}"


def run_demo(args: argparse.Namespace) -> int:
    from producer import Client

    from .local import local_worker

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.redis_url is None:
        print("the demo's embedded Redis is ephemeral: its jobs and results are gone when the demo ends "
              "(`redline worker` keeps its data)")
    with local_worker(args.model, args.load_format, args.device, args.redis_url) as local:
        return _produce(Client(local.url, local.queue), args)


def _produce(client, args: argparse.Namespace) -> int:
    jobs = _jobs(args.num_jobs, args.max_tokens)
    start = time.perf_counter()
    ids = client.submit_many(jobs)
    print(f"\nsubmitted {len(ids)} jobs; streaming the first one:\n  ", end="", flush=True)
    for delta in client.stream(ids[0], timeout=120):
        print("".join(c if c.isprintable() else "·" for c in delta.text), end="", flush=True)
    print("\n")
    results = [client.result(i, timeout=300) for i in ids]
    seconds = time.perf_counter() - start
    for job, res in zip(jobs, results):
        text = res.text.replace("\n", " ")
        print(f"[{res.status}] {_describe(job)[:60]}\n    → {text[:100]!r}")
    tokens = sum(r.usage.completion_tokens for r in results)
    print(f"\n{len(results)} jobs, {tokens} tokens in {seconds:.2f} s: {tokens / seconds:,.0f} tok/s through the queue")
    failed = [r for r in results if not r.ok]
    for r in failed:
        print(f"job {r.job_id} {r.status}: {r.error}")
    return 1 if failed else 0
