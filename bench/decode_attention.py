"""Reproduces docs/performance.md's decode attention against its floor: the engine's decode attention layer replayed
on the batches nano-bench's decode steps hold, against reading their K/V once at the rate this GPU reads memory.
    python3 bench/decode_attention.py [--every 50] [--model qwen3-0.6b] [--kv-cache-dtype fp8]     (one GPU)

The workload is worker.bench_engine's (seed 0, 256 sequences). At every --every-th decode step the batch is the
sequences still generating, each with its prompt and tokens so far in a paged cache of 256-position pages
drawn in random order. One layer's attention runs as the engine's decode graphs run it (the Attention layer
over the triton backend: q/k norm, rotary, the new token's K/V stored, split-KV attention and the merge in
one kernel; splits chosen for max_model_len, sequences longest first), --launches times back to back in a
CUDA graph, and its wall time per launch is set against the step's K/V bytes at the read rate `x.sum()`
reaches here. The whole run's attention is interpolated between the sampled steps, times the layers.
Prints a line per sampled step and one JSON line.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the tree this script is in

from engine.attention import AttentionMetadata, ForwardContext, get_backend  # noqa: E402
from engine.config import KV_CACHE_DTYPES, load_hf_config  # noqa: E402
from engine.layers.attention import Attention  # noqa: E402
from engine.layers.fusion import takes_gemv  # noqa: E402
from engine.layers.norm import RMSNorm  # noqa: E402
from engine.layers.rotary import RotaryEmbedding, rope_settings  # noqa: E402
from worker import bench_engine as bench  # noqa: E402

PAGE = 256  # the engine's KV block on a GPU


def graph_ms(fn, replays: int = 5) -> float:
    """Median milliseconds of one replay of a CUDA graph of fn (warmed up first)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def read_rate(gib: int = 4) -> float:
    """Bytes a second `x.sum()` reads from a buffer L2 cannot hold, in a CUDA graph of back-to-back sums."""
    x = torch.ones(gib << 29, dtype=torch.bfloat16, device="cuda")
    sums = 4
    ms = graph_ms(lambda: [x.sum(dtype=torch.float32) for _ in range(sums)])
    rate = sums * x.numel() * x.element_size() / (ms / 1e3)
    del x
    torch.cuda.empty_cache()
    return rate


def lengths(args: argparse.Namespace) -> tuple[list[int], list[int]]:
    """Prompt and output lengths of the bench's workload."""
    prompts, params = bench.make_workload(args)
    return [len(p) for p in prompts], [sp.max_tokens for sp in params]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    bench.add_arguments(parser)
    parser.add_argument("--every", type=int, default=50, help="sample every this many decode steps")
    parser.add_argument("--launches", type=int, default=10, help="back-to-back launches of the layer a graph")
    args = parser.parse_args()
    bench.check_arguments(args)  # also cuts the prompt ids to the vocabulary, as the bench draws them
    dev = torch.device("cuda")
    cfg = load_hf_config(bench.resolve_model(args.model))
    dtype = torch.bfloat16
    kv_dtype = KV_CACHE_DTYPES[args.kv_cache_dtype] or dtype
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    layers = cfg.num_hidden_layers
    read_bw = read_rate()

    ins, outs = lengths(args)
    torch.manual_seed(0)
    rng = random.Random(0)
    pages_of = [-(-(i + o) // PAGE) for i, o in zip(ins, outs)]
    pool = list(range(sum(pages_of)))
    rng.shuffle(pool)
    tables, at = [], 0
    for n in pages_of:
        tables.append(pool[at:at + n])
        at += n
    width = max(pages_of)
    k_cache, v_cache = (torch.randn(len(pool), PAGE, kv_heads, head_dim, device=dev).to(kv_dtype) for _ in range(2))

    backend = get_backend("triton", dev, kv_dtype)
    ctx = ForwardContext(backend)
    attn = Attention(heads, kv_heads, head_dim, head_dim ** -0.5, ctx)
    attn.k_cache, attn.v_cache = k_cache, v_cache
    theta, scaling = rope_settings(cfg)
    rotary = RotaryEmbedding(head_dim, cfg.max_position_embeddings, theta, scaling).to(dev, dtype)
    q_norm, k_norm = (RMSNorm(head_dim, cfg.rms_norm_eps).to(dev, dtype) for _ in range(2))
    qkv_weight = torch.empty((heads + 2 * kv_heads) * head_dim, cfg.hidden_size, device=dev, dtype=dtype)
    kv_bytes = kv_heads * head_dim * 2 * kv_dtype.itemsize  # one position of one layer, K and V

    steps = list(range(0, max(outs), args.every)) + [max(outs) - 1]
    per_step = {}
    for s in steps:
        live = [i for i, o in enumerate(outs) if o > s]
        lens = [ins[i] + s + 1 for i in live]
        rows = len(live)
        seqlens = torch.tensor(lens, device=dev, dtype=torch.int32)
        table = torch.tensor([tables[i] + [0] * (width - len(tables[i])) for i in live], device=dev, dtype=torch.int32)
        slots = torch.tensor([tables[i][(n - 1) // PAGE] * PAGE + (n - 1) % PAGE for i, n in zip(live, lens)],
                             device=dev, dtype=torch.int64)
        positions = (seqlens - 1).to(torch.int64)
        qkv = torch.randn(rows, (heads + 2 * kv_heads) * head_dim, device=dev).to(dtype)
        ctx.meta = meta = AttentionMetadata(slots, torch.arange(rows + 1, device=dev, dtype=torch.int32), seqlens,
                                            table, 1, args.max_model_len, True)
        prepare = getattr(backend, "prepare", None)
        if prepare is not None:  # what the model does before a forward pass's first kernel: the decode order
            prepare(meta)
        after_gemv = takes_gemv(qkv, qkv_weight)  # as the layer tells the kernel at this batch size

        def layer_calls():
            for _ in range(args.launches):
                attn(qkv, positions, rotary, q_norm, k_norm, after_gemv)
        us = graph_ms(layer_calls) * 1e3 / args.launches
        ctx.meta = None
        floor_us = sum(lens) * kv_bytes / read_bw * 1e6
        per_step[s] = us
        print(f"step {s:5d}: {rows:4d} sequences, {sum(lens) * kv_bytes / 1e6:7.1f} MB of K/V a layer, "
              f"floor {floor_us:7.1f} us, attention {us:7.1f} us ({us / floor_us - 1:+.1%})", flush=True)

    total_us = floor_bytes = 0.0
    for s in range(max(outs)):  # every decode step, interpolated between the sampled ones
        below = max(k for k in steps if k <= s)
        above = min((k for k in steps if k >= s), default=below)
        weight = 0.0 if above == below else (s - below) / (above - below)
        total_us += per_step[below] + (per_step[above] - per_step[below]) * weight
        floor_bytes += sum(ins[i] + s + 1 for i, o in enumerate(outs) if o > s) * kv_bytes
    attention_s, floor_s = total_us * layers / 1e6, floor_bytes * layers / read_bw
    commit = bench.git_commit(getattr(args, "commit", None))
    print(json.dumps({"gpu": bench.gpu_name(), "commit": commit, "model": args.model,
                      "kv_cache_dtype": args.kv_cache_dtype, "read_tb_s": round(read_bw / 1e12, 3),
                      "kv_tb": round(floor_bytes * layers / 1e12, 2), "floor_seconds": round(floor_s, 3),
                      "attention_seconds": round(attention_s, 3), "over_floor": round(attention_s / floor_s - 1, 3),
                      "steps_us": {s: round(v, 1) for s, v in per_step.items()}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
