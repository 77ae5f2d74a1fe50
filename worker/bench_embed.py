"""The embedding benchmark (`redline bench --embed`): embed random texts on dummy weights of an embedding shape.

Workload: random.seed(seed); --num-texts texts (100,000 by default) of randint(--min-text-len,
--max-text-len) token ids (50 to 500) in [0, --max-token-id]. Throughput is prompt tokens over the wall
seconds of one LLM.embed after a warm-up. The floor is prefill's compute: 2 x the parameters a token
multiplies (all but the embedding table: an embedding runs no LM head) x the tokens, over the GPU's peak
dense bf16 FLOP/s (attention's own FLOPs left out, a few percent at these lengths).
"""
from __future__ import annotations

import argparse
import json
import random
import time
from datetime import datetime, timezone
from pathlib import Path

from worker import bench_engine

DEFAULT_EMBED_MODEL = "qwen3-embedding-0.6b"
# dense bf16 FLOP/s without sparsity, from the vendors' data sheets (H100 and H200 SXM)
PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12}
WARM_UP_TEXTS = 2048  # enough batches to compile every prefill kernel the timed run meets


def add_arguments(parser: argparse.ArgumentParser) -> None:
    e = parser.add_argument_group("embedding workload (--embed)")
    e.add_argument("--embed", action="store_true",
                   help=f"embed random texts (default model {DEFAULT_EMBED_MODEL}) instead of the generation bench")
    e.add_argument("--num-texts", type=int, default=100_000)
    e.add_argument("--min-text-len", type=int, default=50)
    e.add_argument("--max-text-len", type=int, default=500)
    e.add_argument("--peak-flops", type=float, default=None,
                   help="the GPU's peak dense bf16 FLOP/s for the floor [H100/H200: 989e12]")


def check_arguments(args: argparse.Namespace) -> None:
    """ValueError naming the flag for a workload that cannot be drawn."""
    if args.model == bench_engine.DEFAULT_MODEL:
        args.model = DEFAULT_EMBED_MODEL
    if args.num_texts < 1:
        raise ValueError(f"--num-texts must be at least 1, got {args.num_texts}")
    if not 1 <= args.min_text_len <= args.max_text_len:
        raise ValueError(f"--min-text-len ({args.min_text_len}) must be at least 1 and at most --max-text-len "
                         f"({args.max_text_len})")
    if args.peak_flops is not None and args.peak_flops <= 0:
        raise ValueError(f"--peak-flops must be positive, got {args.peak_flops}")
    args.min_input_len, args.max_input_len = args.min_text_len, args.max_text_len  # what the engine checks read
    bench_engine.check_arguments(args)


def make_texts(args: argparse.Namespace, count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    ids = range(args.max_token_id + 1)  # choices, not a randint per id: 100,000 texts take seconds, not a minute
    return [rng.choices(ids, k=rng.randint(args.min_text_len, args.max_text_len)) for _ in range(count)]


def floor_seconds(hf_config, tokens: int, peak_flops: float) -> float:
    """Prefill's compute for `tokens` tokens: 2 FLOPs per multiplied parameter, the embedding table excluded."""
    c = hf_config
    tied = getattr(c, "tie_word_embeddings", False)
    multiplied = bench_engine.count_parameters(c) - c.vocab_size * c.hidden_size * (1 if tied else 2)
    return 2 * multiplied * tokens / peak_flops


def run(args: argparse.Namespace) -> dict:
    """Warm up, time one embed of the workload, print a summary and one JSON line; return the record."""
    check_arguments(args)
    texts = make_texts(args, args.num_texts, args.seed)
    llm = bench_engine.build_llm(args)
    llm.embed(make_texts(args, min(WARM_UP_TEXTS, args.num_texts), args.seed + 1), use_tqdm=False)
    compiles = bench_engine.watch_compiles()
    start = time.perf_counter()
    outputs = llm.embed(texts, use_tqdm=False)
    seconds = time.perf_counter() - start
    compiled, _ = compiles()
    tokens = sum(len(t) for t in texts)
    assert len(outputs) == len(texts) and all(o.embedding is not None for o in outputs)
    gpu = bench_engine.gpu_name()
    peak = args.peak_flops or next((f for key, f in PEAK_BF16_FLOPS.items() if key in gpu), None)
    floor = floor_seconds(llm.config.hf_config, tokens, peak) if peak else None
    record = {
        "gpu": gpu, "commit": bench_engine.git_commit(getattr(args, "commit", None)),
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
        "model": Path(bench_engine.resolve_model(args.model)).name, "workload": "embed",
        "num_texts": len(texts), "tokens": tokens, "seconds": round(seconds, 3), "tok_s": round(tokens / seconds, 1),
        "floor_seconds": round(floor, 3) if floor else None,
        "share_of_floor": round(floor / seconds, 3) if floor else None,
        "kernels_compiled_in_run": compiled,
    }
    print(f"{record['model']} on {gpu}: embedded {len(texts):,} texts, {tokens:,} tokens in {seconds:.2f} s = "
          f"{tokens / seconds:,.0f} tok/s" + (f"; compute floor {floor:.2f} s, {floor / seconds:.2f} of it" if floor
                                             else ""))
    print(json.dumps(record), flush=True)
    llm.shutdown()
    return record
