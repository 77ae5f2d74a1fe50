"""Queue a tensor's first bytes into the L2 cache (Hopper's cp.async.bulk.prefetch.L2), nothing else.

Under tensor parallelism a decode step waits on NVLink twice a layer (the all-reduce after each
row-parallel projection) while HBM sits idle, and the GEMM right after each wait streams megabytes of
weights from HBM. Launched on a side stream beside the all-reduce, this kernel fills L2 with the start
of those weights meanwhile, so the GEMM finds them there. A program cannot end before its bulk
prefetches have landed, so the caller sizes the prefetch to about what the wait hides.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

CHUNK = 32 << 10   # bytes per prefetch instruction
LANES = 32         # prefetch instructions a program issues per loop iteration
PROGRAMS = 32      # one SM's bulk-copy unit fetches ~0.4 TB/s: spread over this many


@triton.jit
def _l2_prefetch_kernel(ptr, nbytes, CHUNK: tl.constexpr, LANES: tl.constexpr):
    base = ptr.to(tl.pointer_type(tl.int8))
    num_chunks = tl.cdiv(nbytes, CHUNK)
    for first in range(tl.program_id(0) * LANES, num_chunks, tl.num_programs(0) * LANES):
        chunk = first + tl.arange(0, LANES)
        offset = chunk.to(tl.int64) * CHUNK
        # the last chunk stops at nbytes (a multiple of 16); lanes past the end issue nothing
        size = tl.where(chunk < num_chunks, tl.minimum(nbytes - offset, CHUNK), 0).to(tl.int32) & ~15
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.b32 $0, 0; }",
            "=r,l,r", [base + offset, size], dtype=tl.int32, is_pure=False, pack=1)


def l2_prefetch(t: torch.Tensor, nbytes: int, programs: int = PROGRAMS) -> None:
    """Queue up to `nbytes` from the start of CUDA tensor `t` (contiguous) into L2; returns at once on
    the host, and the kernel ends once the lines have landed. Needs compute capability 9.0 or later."""
    nbytes = min(nbytes, t.numel() * t.element_size()) & ~15
    if nbytes <= 0:
        return
    programs = max(1, min(programs, triton.cdiv(nbytes, CHUNK)))
    _l2_prefetch_kernel[(programs,)](t, nbytes, CHUNK=CHUNK, LANES=LANES, num_warps=1)
