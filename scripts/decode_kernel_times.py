"""Decode attention kernel by kernel: the split-KV and merge kernels' own GPU time (from the profiler,
so without the gaps between graph replays) on bench-like unequal lengths and on equal lengths, with
the engine's cache layout ([pages, page size, KV heads, D]) and with a head-major view of the same
bytes ([pages, KV heads, page size, D] memory), against the time to read those K/V bytes once.

    python scripts/decode_kernel_times.py [--read-bw 3.058e12] [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from collections import defaultdict
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests")]

from kernel_cases import make_case, reference_attention, relative_error  # noqa: E402

from engine.kernels import paged_decode  # noqa: E402
from engine.kernels.paged_decode import decode_order  # noqa: E402


def head_major(cache: torch.Tensor) -> torch.Tensor:
    """The same values in [pages, KV heads, page size, D] memory, viewed as [pages, page size, KV heads, D]."""
    return cache.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)


def kernel_times(fn, replays: int = 20) -> dict[str, float]:
    """Mean GPU microseconds per replay of each kernel `fn` launches, replayed in a CUDA graph."""
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(5):
        graph.replay()
    torch.cuda.synchronize()
    totals: dict[str, float] = defaultdict(float)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            totals[event.name] += event.device_time / replays if hasattr(event, "device_time") else event.cuda_time / replays
    return dict(totals)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--read-bw", type=float, default=3.058e12, help="bytes/s a read-only kernel reaches")
    parser.add_argument("--out", default=os.environ.get("OUT", "out"))
    args = parser.parse_args()
    rows = []
    for model, heads, kv_heads in (("qwen3-0.6b", 16, 8), ("qwen3-8b tp2", 16, 4)):
        for lengths_name in ("100-2048", "1024"):
            for batch in (16, 64, 128, 256):
                if lengths_name == "1024":
                    lengths = [1024] * batch
                else:
                    lengths = torch.randint(100, 2049, (batch,), generator=torch.Generator().manual_seed(batch)).tolist()
                case = make_case([1] * batch, lengths, heads, kv_heads, 128, 256, torch.bfloat16, "cuda", seed=batch)
                ref = reference_attention(case)
                nbytes = sum(lengths) * kv_heads * 128 * 2 * 2
                floor_us = nbytes / args.read_bw * 1e6
                order = decode_order(case.seqlens_k)
                for layout in ("engine", "head-major"):
                    k_cache = case.k_cache if layout == "engine" else head_major(case.k_cache)
                    v_cache = case.v_cache if layout == "engine" else head_major(case.v_cache)
                    out = torch.empty_like(case.q)
                    times = kernel_times(lambda: paged_decode(case.q, k_cache, v_cache, case.seqlens_k, case.block_tables,
                                                              4096, case.scale, out=out, order=order))
                    split = sum(t for n, t in times.items() if "split" in n)
                    merge = sum(t for n, t in times.items() if "merge" in n)
                    row = dict(model=model, lengths=lengths_name, batch=batch, layout=layout, split_us=split,
                               merge_us=merge, floor_us=floor_us, err=relative_error(out, ref),
                               other={n: t for n, t in times.items() if "split" not in n and "merge" not in n})
                    rows.append(row)
                    print(f"{model:13s} {lengths_name:9s} b={batch:4d} {layout:10s} split {split:7.1f} us  merge {merge:5.1f} us"
                          f"  floor {floor_us:7.1f} us  split-floor {split - floor_us:6.1f} us  "
                          f"{nbytes / (split + merge) / 1e6:.3f} TB/s  err {row['err']:.1e}", flush=True)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    Path(args.out, "decode_kernel_times.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
