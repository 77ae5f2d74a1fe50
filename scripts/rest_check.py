"""What a decode layer's projections and small kernels cost without the attention, in variants (GPU only).

    PYTHONPATH=. python3 scripts/rest_check.py [--batches 16,64,128,256] [--layers 28]

The Qwen3-0.6B decode layer's work outside its attention, from the engine's kernels, in one CUDA graph of
--layers layers (the attention's output is a fixed tensor), ms a step:
  engine    RMSNorm with the residual add, qkv, o, RMSNorm with the residual add, gate_up, SiLU·mul, down
            (cuBLAS projections, as the engine runs batches past the GEMV's and the TMA GEMM's rows);
  hot       the same, every layer with the first layer's weights (31 MB, which L2 can hold): what the
            projections would cost with their weights already on chip;
  no_small  the projections alone, no norm and no SiLU·mul kernel (wrong values): what those kernels cost;
  folded    the norms' weights folded into the projections after them, so no norm kernel: o and down add
            the residual in cuBLAS's epilogue (addmm_ into the residual), and the row's 1 / rms is applied
            downstream: SiLU·mul scales gate and up by it (a kernel that reads the row), and the attention
            would scale its q, k, v (not timed here: this script has no attention).
Prints a line per batch and one JSON line (median of 5 rounds of 20 replays).
"""
from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from engine.kernels.launch import launch_dependents, pdl_options, wait_for_previous
from engine.kernels.norm_act import rms_norm, silu_and_mul

from overlap_check import EPS, HEAD_DIM, HEADS, HIDDEN, INTER, Layer, graph_ms  # this folder is on sys.path


@triton.jit
def _silu_mul_scaled_kernel(x_ptr, h_ptr, out_ptr, width, hidden, eps, stride_x, stride_h, stride_o,
                            BLOCK: tl.constexpr, HIDDEN_PAD: tl.constexpr, PDL: tl.constexpr):
    launch_dependents(PDL)
    wait_for_previous(PDL)
    row = tl.program_id(0)
    col = tl.program_id(1)
    offs_h = tl.arange(0, HIDDEN_PAD)
    h = tl.load(h_ptr + row.to(tl.int64) * stride_h + offs_h, mask=offs_h < hidden, other=0.0).to(tl.float32)
    inv = tl.math.rsqrt(tl.sum(h * h, axis=0) / hidden + eps)
    offs = col * BLOCK + tl.arange(0, BLOCK)
    mask = offs < width
    src = x_ptr + row.to(tl.int64) * stride_x + offs
    gate = tl.load(src, mask=mask, other=0.0).to(tl.float32) * inv
    up = tl.load(src + width, mask=mask, other=0.0).to(tl.float32) * inv
    act = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row.to(tl.int64) * stride_o + offs, act.to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul_scaled(x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """silu(s gate) * (s up), s = 1 / rms of h's row."""
    width = x.shape[1] // 2
    out = torch.empty(x.shape[0], width, dtype=x.dtype, device=x.device)
    block = 1024
    _silu_mul_scaled_kernel[(x.shape[0], triton.cdiv(width, block))](
        x, h, out, width, h.shape[1], EPS, x.stride(0), h.stride(0), out.stride(0), BLOCK=block,
        HIDDEN_PAD=triton.next_power_of_2(h.shape[1]), num_warps=4, **pdl_options(x))
    return out


def engine_step(layers, att, x, res):
    for layer in layers:
        h, res = rms_norm(x, layer.norm1, EPS, residual=res)
        F.linear(h, layer.qkv)
        o = F.linear(att, layer.o)
        h, res = rms_norm(o, layer.norm2, EPS, residual=res)
        x = F.linear(silu_and_mul(F.linear(h, layer.gate_up)), layer.down)
    return x, res


def no_small_step(layers, att, x, res):
    for layer in layers:
        F.linear(x, layer.qkv)
        o = F.linear(att, layer.o)
        x = F.linear(F.linear(o, layer.gate_up)[:, :INTER], layer.down)
    return x


def folded_step(layers, att, res):
    for layer in layers:
        F.linear(res, layer.qkv)
        res.addmm_(att, layer.o.t())
        act = silu_mul_scaled(F.linear(res, layer.gate_up), res)
        res.addmm_(act, layer.down.t())
    return res


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="16,64,128,256")
    parser.add_argument("--layers", type=int, default=28)
    args = parser.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    layers = [Layer(gen) for _ in range(args.layers)]
    rows = []
    for batch in (int(v) for v in args.batches.split(",")):
        def rand(*shape):
            return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.1
        att, x, res = rand(batch, HEADS * HEAD_DIM), rand(batch, HIDDEN), rand(batch, HIDDEN)
        res_folded = res.clone()  # folded_step adds into its residual in place
        row = {"rows": batch}
        for _ in range(2):  # two rounds, alternating
            for name, fn in (("engine", lambda: engine_step(layers, att, x, res)),
                             ("hot", lambda: engine_step([layers[0]] * len(layers), att, x, res)),
                             ("no_small", lambda: no_small_step(layers, att, x, res)),
                             ("folded", lambda: folded_step(layers, att, res_folded))):
                row.setdefault(name, []).append(round(graph_ms(fn), 4))
        rows.append(row)
        print(" ".join(f"{k}={v}" for k, v in row.items()), flush=True)
    print(json.dumps({"gpu": torch.cuda.get_device_name(), "layers": args.layers, "rows": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
