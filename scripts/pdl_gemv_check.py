"""Does a chain of weight-streaming GEMVs run closer to HBM bandwidth when each kernel is launched with
programmatic dependent launch, triggers its dependents at once and loads its weights before it waits?

    PYTHONPATH=. python3 scripts/pdl_gemv_check.py [--rows 1] [--layers 28]

The GEMMs of a batch-1 decode step of the Qwen3-0.6B shape (per layer qkv, o, gate_up, down; distinct
weights per layer, so L2 holds none of them across the step), chained as the layer chains them, captured
in one CUDA graph. Variants: cuBLAS (F.linear); the engine-style Triton GEMV launched plainly; the same
with PDL, waiting first (as the removed REDLINE_PDL did); with PDL, an early trigger and the weights
loaded before the wait. Checks every Triton variant's output against cuBLAS first. Prints one JSON line.
"""
from __future__ import annotations

import argparse
import json

import torch
import triton
import triton.language as tl

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # older Triton
    gdc_wait = tl.extra.cuda.gdc_wait
    gdc_launch_dependents = tl.extra.cuda.gdc_launch_dependents

SHAPES = (("qkv", 4096, 1024), ("o", 1024, 2048), ("gate_up", 6144, 1024), ("down", 1024, 3072))


@triton.jit
def _gemv(x_ptr, w_ptr, out_ptr, K, stride_w, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
          PDL: tl.constexpr, EARLY: tl.constexpr):
    pid = tl.program_id(0)
    if PDL and EARLY:
        gdc_launch_dependents()
    if PDL and not EARLY:
        gdc_wait()
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    k_mask = offs_k < K
    w = tl.load(w_ptr + offs_n[:, None] * stride_w + offs_k[None, :], mask=k_mask[None, :], other=0.0)
    if PDL and EARLY:
        gdc_wait()
    x = tl.load(x_ptr + offs_k, mask=k_mask, other=0.0)
    acc = tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
    tl.store(out_ptr + offs_n, acc.to(out_ptr.dtype.element_ty))


@triton.jit
def _prefetch_l2(base, nbytes, CHUNK: tl.constexpr, LANES: tl.constexpr):
    """Queue nbytes from base into L2 (Hopper bulk prefetch), LANES chunks of CHUNK bytes per instruction row."""
    for first in range(0, tl.cdiv(nbytes, CHUNK), LANES):
        chunk = first + tl.arange(0, LANES)
        offset = chunk.to(tl.int64) * CHUNK
        size = tl.where(offset < nbytes, tl.minimum(nbytes - offset, CHUNK), 0).to(tl.int32) & ~15
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.b32 $0, 0; }",
            "=r,l,r", [base + offset, size], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _gemm(x_ptr, w_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
          PREFETCH: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    if PDL:
        gdc_launch_dependents()
    if PREFETCH:
        if pid_m == 0:
            _prefetch_l2(w_ptr.to(tl.pointer_type(tl.int8)) + pid_n.to(tl.int64) * BLOCK_N * stride_wn * 2,
                         BLOCK_N * K * 2, 16384, 8)
    if PDL:
        gdc_wait()
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a = tl.load(x_ptr + offs_m[:, None] * stride_xm + (k0 + offs_k)[None, :], mask=m_mask[:, None], other=0.0)
        b = tl.load(w_ptr + offs_n[:, None] * stride_wn + (k0 + offs_k)[None, :])
        acc = tl.dot(a, tl.trans(b), acc)
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=m_mask[:, None])


def triton_gemm(x, w, out, pdl, prefetch, bm, bn, bk, warps, stages):
    m, k = x.shape
    n = w.shape[0]
    kwargs = {"launch_pdl": True} if pdl else {}
    _gemm[(triton.cdiv(n, bn), triton.cdiv(m, bm))](x, w, out, m, n, k, x.stride(0), w.stride(0), out.stride(0),
                                                   BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, PDL=pdl, PREFETCH=prefetch,
                                                   num_warps=warps, num_stages=stages, **kwargs)
    return out


def block_n_for(n: int, k: int) -> int:
    return 8 if k > 2048 else 16


def triton_gemv(x, w, out, pdl: bool, early: bool, warps: int):
    n, k = w.shape
    bn = block_n_for(n, k)
    kwargs = {"launch_pdl": True} if pdl else {}
    _gemv[(triton.cdiv(n, bn),)](x, w, out, k, w.stride(0), BLOCK_N=bn, BLOCK_K=triton.next_power_of_2(k),
                                 PDL=pdl, EARLY=early, num_warps=warps, **kwargs)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--replays", type=int, default=50)
    parser.add_argument("--rows", type=int, default=1, help="x rows; above 16 the tl.dot GEMM variants run")
    args = parser.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    weights = [{name: torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.03 for name, n, k in SHAPES}
               for _ in range(args.layers)]
    total_bytes = sum(w.numel() * 2 for layer in weights for w in layer.values())
    rows = args.rows
    x0 = torch.randn(rows, 1024, device=dev, dtype=torch.bfloat16)
    bufs = {name: torch.empty(rows, n, device=dev, dtype=torch.bfloat16) for name, n, _ in SHAPES}

    def chain(gemm):
        x = x0
        for layer in weights:
            qkv = gemm(x, layer["qkv"], bufs["qkv"])
            o = gemm(qkv[:, :2048], layer["o"], bufs["o"])
            gu = gemm(o, layer["gate_up"], bufs["gate_up"])
            x = gemm(gu[:, :3072], layer["down"], bufs["down"])
        return x

    variants = {"cublas": lambda x, w, out: torch.mm(x, w.t(), out=out)}
    if rows > 16:
        for bm, bn, bk, warps, stages in ((64, 64, 64, 4, 4), (64, 128, 64, 4, 3), (128, 64, 64, 4, 3),
                                          (128, 128, 64, 8, 3), (min(rows, 256), 64, 64, 8, 3)):
            tag = f"m{bm}n{bn}k{bk}w{warps}s{stages}"
            for pdl, prefetch in ((False, False), (True, False), (True, True)):
                name = f"dot_{tag}" + ("_pdl" if pdl else "") + ("_l2" if prefetch else "")
                variants[name] = (lambda x, w, out, a=(pdl, prefetch, bm, bn, bk, warps, stages):
                                  triton_gemm(x, w, out, *a))
    else:
        variants.update(gemv_variants())
    record = {"gpu": torch.cuda.get_device_name(), "layers": args.layers, "rows": rows,
              "weight_mb": round(total_bytes / 1e6, 1)}
    run_variants(variants, chain, record, total_bytes, args.replays)
    print(json.dumps(record), flush=True)


def gemv_variants() -> dict:
    return {
        "triton": lambda x, w, out: triton_gemv(x, w, out, False, False, 4),
        "triton_pdl_wait_first": lambda x, w, out: triton_gemv(x, w, out, True, False, 4),
        "triton_pdl_early": lambda x, w, out: triton_gemv(x, w, out, True, True, 4),
        "triton_pdl_early_w8": lambda x, w, out: triton_gemv(x, w, out, True, True, 8),
    }


def run_variants(variants: dict, chain, record: dict, total_bytes: int, replays: int) -> None:
    ref = chain(variants["cublas"]).float().clone()
    for name, gemm in variants.items():
        try:
            out = chain(gemm).float()
            rel = ((out - ref).norm() / ref.norm()).item()
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                chain(gemm)
            for _ in range(3):
                graph.replay()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            times = []
            for _ in range(5):
                start.record()
                for _ in range(replays):
                    graph.replay()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / replays * 1e3)
            us = sorted(times)[len(times) // 2]
            record[name] = {"us_per_step": round(us, 1), "tb_s": round(total_bytes / us / 1e6, 2),
                            "rel_err_vs_cublas": round(rel, 5)}
        except Exception as e:  # noqa: BLE001 (report and go on with the other variants)
            record[name] = {"error": f"{type(e).__name__}: {e}"[:300]}
        print(name, record[name], flush=True)


if __name__ == "__main__":
    main()
