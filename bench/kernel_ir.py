"""The engine's Triton kernels compiled for a GPU this machine need not have, as the engine would launch them, with
counts from their IR and PTX: where a kernel does more work than its shapes need. No number here is a time.
    python3 bench/kernel_ir.py [--kernels sampling,rms_norm,...] [--arch 90] [--dump DIR]     (no GPU needed)

Each case calls the engine's own Python wrapper on CPU tensors of the engine's shapes (Qwen3-0.6B), with
the kernel's launch intercepted: Triton's binder specialises the arguments as a launch on the GPU would
(values of 1, 16-byte alignments and divisibility of integers, from the tensors' addresses and the ints),
and the kernel is compiled for `--arch` (sm_90: H100/H200) without running. Printed per kernel, per thread:
PTX instructions, 32-bit high multiplies (Philox rounds, hashing), fast logs, global loads by width,
shared-memory loads/stores, barriers, warp shuffles, and the IR's layout conversions; with ptxas on the
path (Triton ships one), registers and spills. --dump writes each kernel's TTGIR and PTX. A count that
moves is a lead to time on the GPU, not a result.
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, VOCAB = 1024, 16, 8, 128, 3072, 151936


class _FirstLaunch(Exception):
    """Ends the call at its first launch (capture): what follows may read results no kernel computed."""


def _launches(call, first_only: bool) -> list:
    from triton.runtime.jit import JITFunction

    recorded, original = [], JITFunction.run

    def record(self, *args, grid, warmup, **kwargs):
        recorded.append((self, args, kwargs))
        if first_only:
            raise _FirstLaunch
    JITFunction.run = record
    try:
        call()
    except _FirstLaunch:
        pass
    finally:
        JITFunction.run = original
    return recorded


def capture(call):
    """(JITFunction, args, kwargs) of the first Triton launch `call()` makes."""
    found = _launches(call, first_only=True)
    if not found:
        raise RuntimeError("the call launched no Triton kernel")
    return found[0]


def launches(call) -> list:
    """(JITFunction, args, kwargs) of every Triton launch `call()` makes, none of them run."""
    return _launches(call, first_only=False)


# compile-time switches the wrappers set from the tensors' device: their values on a CUDA GPU
ON_CUDA = {"PDL": True, "FAST_LOG": True, "UPCAST": False}


def compile_for(kernel, args, kwargs, arch: int):
    """Compile `kernel` as Triton would for this launch on a GPU of compute capability `arch` (the switches
    in ON_CUDA set as the wrapper sets them for CUDA tensors)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile, make_backend
    from triton.runtime.jit import create_function_from_signature

    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    kwargs = {k: (ON_CUDA[k] if k in ON_CUDA else v) for k, v in kwargs.items()
              if k not in ("launch_pdl", "launch_cooperative_grid")}
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, specialization, options)
    return compile(ASTSource(kernel, signature, constexprs, attrs), target=target, options=options.__dict__)


def counts(compiled, arch: int) -> dict:
    ir, ptx = compiled.asm["ttgir"], compiled.asm["ptx"]
    body = [line.strip() for line in ptx.splitlines()
            if line.strip() and not line.strip().startswith(("//", ".", "$", "{", "}", "@@"))]
    loads = collections.Counter(re.sub(r"ld\.global(\.[a-z:_0-9]+)*?\.((v[248]\.)?[bfsu]\d+)$", r"\2", m)
                                for m in re.findall(r"ld\.global[a-z0-9.:_]*", ptx))
    row = {"ptx_instructions": len(body), "mul_hi": ptx.count("mul.hi"), "lg2": ptx.count("lg2.approx"),
           "loads": dict(sorted(loads.items())), "ld_shared": ptx.count("ld.shared"),
           "st_shared": ptx.count("st.shared"), "barriers": ptx.count("bar.sync") + ptx.count("barrier.sync"),
           "shuffles": ptx.count("shfl.sync"), "layout_conversions": ir.count("ttg.convert_layout"),
           "num_warps": compiled.metadata.num_warps, "shared_bytes": compiled.metadata.shared}
    row.update(_ptxas(ptx, arch))
    return row


def _ptxas(ptx: str, arch: int) -> dict:
    """Registers and spill bytes from ptxas -v, if a ptxas can be found (Triton's own first)."""
    try:
        from triton.backends.nvidia.compiler import get_ptxas
        ptxas = get_ptxas().path
    except Exception:  # noqa: BLE001 - another Triton: look on the path
        ptxas = "ptxas"
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        try:
            out = subprocess.run([ptxas, "-v", f"--gpu-name=sm_{arch}a", str(src), "-o", os.devnull],
                                 capture_output=True, text=True, timeout=120)
        except (OSError, subprocess.TimeoutExpired):
            return {}
    text = out.stdout + out.stderr
    regs = re.search(r"Used (\d+) registers", text)
    spill = re.search(r"(\d+) bytes spill stores", text)
    return {"registers": int(regs.group(1)) if regs else None, "spill_bytes": int(spill.group(1)) if spill else None}


# ---- cases: the engine's wrappers on CPU tensors of the 0.6B shapes ------------------------------------

def _bf16(*shape):
    return torch.randn(*shape).to(torch.bfloat16)


def case_sampling(rows: int = 256, logprobs: bool = False):
    """As the eager sampler launches it, or with logprobs_out and the seed in memory, as the decode graph does."""
    from engine.kernels.sampling import gumbel_argmax
    if not logprobs:
        return lambda: gumbel_argmax(_bf16(rows, VOCAB), torch.ones(rows), 1234)
    return lambda: gumbel_argmax(_bf16(rows, VOCAB), torch.ones(rows), torch.tensor([1234]),
                                 out=torch.empty(rows, dtype=torch.int64), logprobs_out=torch.empty(rows))


def case_rms_norm(rows: int = 256):
    from engine.kernels.norm_act import rms_norm
    return lambda: rms_norm(_bf16(rows, HIDDEN), _bf16(HIDDEN), 1e-6, residual=_bf16(rows, HIDDEN))


def case_silu_mul(rows: int = 256):
    from engine.kernels.norm_act import act_and_mul
    return lambda: act_and_mul(_bf16(rows, 2 * INTER))


def case_gemv(rows: int, n: int, k: int, norm: bool = False, gated: bool = False):
    from engine.kernels.gemv import gemv
    if norm:
        return lambda: gemv(_bf16(rows, k), _bf16(n, k), norm=(_bf16(rows, k), _bf16(k), 1e-6))
    return lambda: gemv(_bf16(rows, 2 * k if gated else k), _bf16(n, k), gated=gated)


def case_fused_decode(rows: int):
    """The fused decode kernel at one row after the GEMV, or at `rows` rows after cuBLAS (longest first),
    with the H100's split count (132 SMs) and the CUDA tiles, over a cache of 256-position pages."""
    from engine.kernels.fused_decode import fused_decode
    from engine.kernels.paged_decode import DecodeConfig, choose_num_splits, decode_order

    page = 256
    lens = [1024] if rows == 1 else [(37 * i) % 2000 + 1 for i in range(rows)]
    pages = [-(-n // page) for n in lens]
    tables = torch.zeros(rows, max(pages), dtype=torch.int32)
    first = 0
    for row, n in enumerate(pages):
        tables[row, :n] = torch.arange(first, first + n, dtype=torch.int32)
        first += n
    seqlens = torch.tensor(lens, dtype=torch.int32)
    positions = (seqlens - 1).to(torch.int64)
    slots = torch.tensor([int(tables[r, (n - 1) // page]) * page + (n - 1) % page for r, n in enumerate(lens)])
    caches = [_bf16(first, page, KV_HEADS, HEAD_DIM) for _ in range(2)]
    table = torch.randn(4096, HEAD_DIM // 2)
    qkv = _bf16(rows, (HEADS + 2 * KV_HEADS) * HEAD_DIM)  # contiguous rows, as the engine's GEMM writes them
    config = DecodeConfig()
    splits = choose_num_splits(rows, KV_HEADS, max(lens), config.block_n, 132, config.grid_programs_per_sm)
    counters = torch.zeros(rows * KV_HEADS, dtype=torch.int32)
    return lambda: fused_decode(qkv, positions, table, table, _bf16(HEAD_DIM), _bf16(HEAD_DIM), 1e-6, caches[0],
                                caches[1], slots, seqlens, tables, max(lens), HEAD_DIM ** -0.5, HEADS, KV_HEADS,
                                counters, order=None if rows == 1 else decode_order(seqlens), num_splits=splits,
                                config=config, after_gemv=rows == 1)


def case_qkv_prep(tokens: int = 4096):
    """qkv preparation of a prefill step: q/k RMSNorm, rotary, K/V stored into a paged cache."""
    from engine.kernels.qkv_prep import qkv_prep

    cache = _bf16(tokens // 256 + 1, 256, KV_HEADS, HEAD_DIM)
    table = torch.randn(4096, HEAD_DIM // 2)
    return lambda: qkv_prep(_bf16(tokens, (HEADS + 2 * KV_HEADS) * HEAD_DIM), torch.arange(tokens), table, table,
                            _bf16(HEAD_DIM), _bf16(HEAD_DIM), 1e-6, cache, cache.clone(), torch.arange(tokens),
                            HEADS, KV_HEADS, HEAD_DIM)


def case_paged_prefill(tokens: int = 1024):
    """Prefill attention of one 1,024-token prompt over its pages, with the CUDA tiles."""
    from engine.kernels.paged_prefill import PrefillConfig, paged_prefill

    pages = tokens // 256
    cache = _bf16(pages, 256, KV_HEADS, HEAD_DIM)
    cu_seqlens = torch.tensor([0, tokens], dtype=torch.int32)
    return lambda: paged_prefill(_bf16(tokens, HEADS, HEAD_DIM), cache, cache.clone(), cu_seqlens, cu_seqlens[1:],
                                 torch.arange(pages, dtype=torch.int32)[None], tokens, HEAD_DIM ** -0.5,
                                 config=PrefillConfig())


CASES = {
    "sampling": case_sampling,
    "sampling_logprobs": lambda: case_sampling(logprobs=True),
    "rms_norm": case_rms_norm,
    "silu_mul": case_silu_mul,
    "gemv_qkv_1row": lambda: case_gemv(1, (HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN, norm=True),
    "gemv_o_1row": lambda: case_gemv(1, HIDDEN, HEADS * HEAD_DIM),
    "gemv_gate_up_1row": lambda: case_gemv(1, 2 * INTER, HIDDEN, norm=True),
    "gemv_down_1row": lambda: case_gemv(1, HIDDEN, INTER, gated=True),
    "gemv_qkv_4rows": lambda: case_gemv(4, (HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN, norm=True),
    "gemv_down_4rows": lambda: case_gemv(4, HIDDEN, INTER, gated=True),
    "fused_decode_1row": lambda: case_fused_decode(1),
    "fused_decode_256rows": lambda: case_fused_decode(256),
    "qkv_prep": case_qkv_prep,
    "paged_prefill": case_paged_prefill,
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernels", default=",".join(CASES), help=f"comma-separated, of: {', '.join(CASES)}")
    parser.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 90 for sm_90")
    parser.add_argument("--dump", default=None, help="directory for each kernel's TTGIR and PTX")
    args = parser.parse_args()
    if os.environ.get("TRITON_INTERPRET") == "1":
        parser.error("unset TRITON_INTERPRET: the interpreter compiles nothing")
    names = [n for n in args.kernels.split(",") if n]
    unknown = [n for n in names if n not in CASES]
    if unknown:
        parser.error(f"unknown kernels {unknown}; known: {', '.join(CASES)}")
    import triton
    print(f"triton {triton.__version__}, sm_{args.arch}", flush=True)
    for name in names:
        kernel, kargs, kkwargs = capture(CASES[name]())
        compiled = compile_for(kernel, kargs, kkwargs, args.arch)
        row = counts(compiled, args.arch)
        print(f"{name} ({kernel.__name__}): " + ", ".join(f"{k} {v}" for k, v in row.items()), flush=True)
        if args.dump:
            out = Path(args.dump)
            out.mkdir(parents=True, exist_ok=True)
            (out / f"{name}.ttgir").write_text(compiled.asm["ttgir"])
            (out / f"{name}.ptx").write_text(compiled.asm["ptx"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
