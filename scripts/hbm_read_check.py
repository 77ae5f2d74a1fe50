"""How fast the GPU's memory can be read, by each way a kernel can read it.

    PYTHONPATH=. python3 scripts/hbm_read_check.py [--gib 4]

The decode attention's floor in docs/kernels-notes.md is its K/V bytes at the rate `x.sum()` reads
(~3.06 TB/s on the H100). This asks whether another way of reading reaches more: a Triton kernel of plain
vector loads (grid sizes, block sizes, warps, cache hints), and a Gluon kernel whose tiles arrive by bulk
tensor copies (TMA) into a ring of shared-memory stages, with and without the tiles then read into
registers. Every variant reads the same buffer, which L2 cannot hold; each is captured in a CUDA graph
whose replays are timed back to back. Prints a table and one JSON line of TB/s by variant.
"""
from __future__ import annotations

import argparse
import json

import torch
import triton
import triton.language as tl

from overlap_check import graph_ms  # run as a script, this folder is on sys.path

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
except ImportError:
    gluon = None


@triton.jit
def _load_read_kernel(x_ptr, out_ptr, per_program, BLOCK: tl.constexpr, HINT: tl.constexpr):
    base = tl.program_id(0).to(tl.int64) * per_program
    acc = tl.zeros([BLOCK], tl.float32)
    for off in range(0, per_program, BLOCK):
        ptrs = x_ptr + base + off + tl.arange(0, BLOCK)
        if HINT == 1:
            v = tl.load(ptrs, cache_modifier=".cg")
        elif HINT == 2:
            v = tl.load(ptrs, eviction_policy="evict_first")
        else:
            v = tl.load(ptrs)
        acc += v.to(tl.float32)
    tl.store(out_ptr + tl.program_id(0), tl.sum(acc))


if gluon is not None:
    @gluon.jit
    def _tma_read_kernel(desc, out_ptr, rows_per_program, STAGES: gl.constexpr, CONSUME: gl.constexpr):
        BR: gl.constexpr = desc.block_type.shape[0]
        BC: gl.constexpr = desc.block_type.shape[1]
        start = gl.program_id(0) * rows_per_program
        n = rows_per_program // BR
        bufs = gl.allocate_shared_memory(desc.dtype, [STAGES, BR, BC], desc.layout)
        bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(bars.index(i), count=1)
        for i in gl.static_range(STAGES):
            mbarrier.expect(bars.index(i), desc.block_type.nbytes, pred=i < n)
            tma.async_copy_global_to_shared(desc, [start + i * BR, 0], bars.index(i), bufs.index(i), pred=i < n)
        layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [gl.num_warps(), 1], [1, 0])
        acc = gl.zeros([BR, BC], gl.float32, layout)
        for t in range(n):
            s = t % STAGES
            mbarrier.wait(bars.index(s), (t // STAGES) & 1)
            if CONSUME:
                acc += bufs.index(s).load(layout).to(gl.float32)
                gl.thread_barrier()
                fence_async_shared()
            ok = t + STAGES < n
            mbarrier.expect(bars.index(s), desc.block_type.nbytes, pred=ok)
            tma.async_copy_global_to_shared(desc, [start + (t + STAGES) * BR, 0], bars.index(s), bufs.index(s),
                                            pred=ok)
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(bars.index(i))
        gl.store(out_ptr + gl.program_id(0), gl.sum(gl.sum(acc, axis=1), axis=0))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=4.0)
    args = parser.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    elems = int(args.gib * (1 << 30)) // 2
    elems -= elems % (sms * 8 * 256 * 64)
    x = torch.randn(elems, device="cuda", dtype=torch.bfloat16)
    nbytes = x.numel() * 2
    out = torch.empty(sms * 16, device="cuda", dtype=torch.float32)
    results: dict[str, float] = {}

    def record(name, fn):
        try:
            ms = graph_ms(fn)
        except Exception as exc:  # noqa: BLE001 - a variant that does not compile is reported, not fatal
            print(f"{name:48s} failed: {type(exc).__name__}: {str(exc)[:120]}", flush=True)
            return
        results[name] = round(nbytes / ms / 1e9, 3)
        print(f"{name:48s} {results[name]:.3f} TB/s  ({ms:.3f} ms)", flush=True)

    record("torch sum", lambda: x.sum(dtype=torch.float32))
    for per_sm in (1, 2, 4, 8):
        for block in (2048, 4096, 8192):
            for warps in (4, 8):
                for hint in (0, 1, 2):
                    if hint and (per_sm, block) != (4, 4096):
                        continue
                    programs = sms * per_sm
                    record(f"loads {programs} programs block {block} warps {warps} hint {hint}",
                           lambda p=programs, b=block, w=warps, h=hint: _load_read_kernel[(p,)](
                               x, out, x.numel() // p, BLOCK=b, HINT=h, num_warps=w))
    if gluon is not None:
        cols = 64
        x2 = x.view(-1, cols)
        for rows, stages, per_sm, consume, warps in ((128, 8, 1, 0, 4), (256, 4, 1, 0, 4), (256, 6, 1, 0, 4),
                                                     (64, 12, 1, 0, 4), (128, 4, 2, 0, 4), (64, 6, 2, 0, 4),
                                                     (128, 8, 1, 1, 4), (128, 8, 1, 1, 8), (64, 8, 2, 1, 4),
                                                     (128, 6, 1, 1, 8)):
            layout = gl.NVMMASharedLayout.get_default_for([rows, cols], gl.bfloat16)
            desc = TensorDescriptor.from_tensor(x2, [rows, cols], layout)
            programs = sms * per_sm
            record(f"tma box {rows}x{cols} stages {stages} programs {programs} consume {consume} warps {warps}",
                   lambda d=desc, p=programs, s=stages, c=consume, w=warps: _tma_read_kernel[(p,)](
                       d, out, x2.shape[0] // p, STAGES=s, CONSUME=c, num_warps=w))
    print(json.dumps({"gpu": torch.cuda.get_device_name(0), "bytes": nbytes, "tb_per_s": results}))


if __name__ == "__main__":
    main()
