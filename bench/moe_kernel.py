"""Reproduces docs/performance.md's fused-MoE figure: one mixture-of-experts layer of a shipped MoE shape (default
qwen3-30b-a3b: 128 experts of 768, top-8, hidden 2048) on random bf16 weights, from the router's logits: the
fused kernels (engine/kernels/fused_moe.py, top-k and align included, in a CUDA graph as the decode steps run
them) against torch's top-k and a loop over the experts the batch touches (engine/layers/moe.py route and
experts_reference, transformers' way).
    python3 bench/moe_kernel.py [--model qwen3-30b-a3b] [--tokens 1 16 256 4096]     (one GPU)

Also the rate each reaches against the floor of one layer: reading the weights of the experts the batch routes
to once, at the rate `x.sum()` reaches here. Prints a line per token count and one JSON line.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the tree this script is in

from engine.builtin import BUILTIN_MODELS  # noqa: E402
from engine.config import load_hf_config  # noqa: E402
from engine.kernels.fused_moe import fused_experts, route_top_k  # noqa: E402
from engine.layers.moe import experts_reference, route  # noqa: E402


def median_ms(fn, graph: bool, repeats: int = 20) -> float:
    """Median milliseconds of fn, replayed from a CUDA graph where graph (warmed up first)."""
    fn()
    if graph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        fn = g.replay
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def read_rate() -> float:
    """Bytes per second x.sum() reads over 2 GiB."""
    x = torch.empty(1 << 30, dtype=torch.bfloat16, device="cuda").normal_()
    return x.numel() * x.element_size() / (median_ms(lambda: x.sum(), graph=False) / 1e3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen3-30b-a3b")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 256, 4096])
    args = parser.parse_args()
    cfg = load_hf_config(BUILTIN_MODELS.get(args.model, args.model))
    hidden = cfg.hidden_size
    inter = getattr(cfg, "moe_intermediate_size", None) or cfg.intermediate_size
    num_experts = getattr(cfg, "num_experts", None) or cfg.num_local_experts
    top_k = cfg.num_experts_per_tok
    gen = torch.Generator(device="cuda").manual_seed(0)
    w13 = (torch.randn(num_experts, 2 * inter, hidden, generator=gen, device="cuda") * 0.02).bfloat16()
    w2 = (torch.randn(num_experts, hidden, inter, generator=gen, device="cuda") * 0.02).bfloat16()
    expert_bytes = 3 * hidden * inter * 2
    rate = read_rate()
    rows = []
    for tokens in args.tokens:
        x = torch.randn(tokens, hidden, generator=gen, device="cuda").bfloat16()
        logits = torch.randn(tokens, num_experts, generator=gen, device="cuda").bfloat16()
        touched = int(torch.unique(route(logits, top_k, True)[1]).numel())
        fused = median_ms(lambda: fused_experts(x, w13, w2, *route_top_k(logits, top_k, True)), graph=True)
        loop = median_ms(lambda: experts_reference(x, w13, w2, *route(logits, top_k, True)), graph=False)
        floor = touched * expert_bytes / rate * 1e3
        rows.append({"tokens": tokens, "experts_touched": touched, "fused_ms": round(fused, 4),
                     "loop_ms": round(loop, 4), "fused_speedup": round(loop / fused, 2),
                     "floor_ms": round(floor, 4), "fused_to_floor": round(fused / floor, 2)})
        print(f"{tokens:>6} tokens, {touched} experts: fused {fused:.3f} ms, loop {loop:.3f} ms "
              f"({loop / fused:.1f}x); floor {floor:.3f} ms ({fused / floor:.2f}x)")
    print(json.dumps({"gpu": torch.cuda.get_device_name(), "model": args.model, "read_bytes_per_s": round(rate),
                      "rows": rows}))


if __name__ == "__main__":
    main()
