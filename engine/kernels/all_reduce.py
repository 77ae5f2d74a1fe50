"""One-shot all-reduce over buffers every rank maps (symmetric memory), whose waits can be called off.

Each program owns a strided share of the elements. It copies its share of this rank's input into this
rank's buffer, signals every peer, waits for every peer's signal, sums every rank's share in rank order
(fp32, rounded once: for two ranks exactly NCCL's bf16 sum), and meets its peers once more before it
returns, so no rank overwrites a buffer a peer still reads. A signal is a flag in the receiver's flag
buffer, set 0 → 1 by the sender and taken 1 → 0 by the receiver; program p only meets program p of
each peer, so the programs of one GPU never wait on each other.

Every wait also polls a stop flag in this rank's device memory. A rank that dies mid-step leaves its
peers' programs waiting on a signal that never comes, and no communicator abort reaches them; setting
the flag (from a side stream, which never queues behind them) makes them return, with a meaningless
sum, so the engine can stop instead of hanging.
"""
from __future__ import annotations

import triton
import triton.language as tl

from engine.kernels.qkv_prep import _round

BLOCK = 2048        # elements per program and iteration
MAX_PROGRAMS = 64   # flags are laid out for this many programs
WARPS = 4


@triton.jit
def _swap_flag(flag, expected, new, stop):
    """Set *flag from `expected` to `new` once it holds `expected`; give up when *stop is set."""
    old = tl.atomic_cas(flag, expected, new, sem="acq_rel", scope="sys")
    halted = tl.load(stop, volatile=True)
    while (old != expected) & (halted == 0):
        old = tl.atomic_cas(flag, expected, new, sem="acq_rel", scope="sys")
        halted = tl.load(stop, volatile=True)


@triton.jit
def _meet_peers(flag_ptrs, phase, rank, stop, W: tl.constexpr, PROGRAMS: tl.constexpr):
    """Signal program `pid` of every peer, then wait for each one's signal (flags [2, PROGRAMS, W])."""
    pid = tl.program_id(0)
    slot = (phase * PROGRAMS + pid) * W
    tl.debug_barrier()  # every thread's stores come before the signal that publishes them
    for q in tl.static_range(W):
        if q != rank:
            peer_flags = tl.load(flag_ptrs + q).to(tl.pointer_type(tl.int32))
            _swap_flag(peer_flags + slot + rank, 0, 1, stop)
    own_flags = tl.load(flag_ptrs + rank).to(tl.pointer_type(tl.int32))
    for q in tl.static_range(W):
        if q != rank:
            _swap_flag(own_flags + slot + q, 1, 0, stop)
    tl.debug_barrier()  # no thread reads a peer's buffer before the signal that published it


@triton.jit(do_not_specialize=["n", "rank"])  # one compiled kernel for every rank and size
def _one_shot_all_reduce(x_ptr, out_ptr, buf_ptrs, flag_ptrs, stop, n, rank,
                         W: tl.constexpr, BLOCK: tl.constexpr, PROGRAMS: tl.constexpr):
    pid = tl.program_id(0)
    step = tl.num_programs(0) * BLOCK
    own_buf = tl.load(buf_ptrs + rank).to(tl.pointer_type(x_ptr.dtype.element_ty))
    for start in range(pid * BLOCK, n, step):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(own_buf + offs, tl.load(x_ptr + offs, mask=mask), mask=mask)
    _meet_peers(flag_ptrs, 0, rank, stop, W, PROGRAMS)
    for start in range(pid * BLOCK, n, step):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < n
        total = tl.zeros([BLOCK], dtype=tl.float32)
        for q in tl.static_range(W):
            buf = tl.load(buf_ptrs + q).to(tl.pointer_type(x_ptr.dtype.element_ty))
            total += tl.load(buf + offs, mask=mask, cache_modifier=".cv").to(tl.float32)
        dtype = out_ptr.dtype.element_ty  # rounded on the bits: the interpreter's cast truncates
        tl.store(out_ptr + offs, _round(total, dtype).to(dtype), mask=mask)
    _meet_peers(flag_ptrs, 1, rank, stop, W, PROGRAMS)


def one_shot_all_reduce(x, out, buf_ptrs, flag_ptrs, stop, rank: int, world_size: int,
                        max_programs: int = MAX_PROGRAMS) -> None:
    """out = the sum over ranks of each rank's x (contiguous, same shape and dtype on every rank).

    buf_ptrs / flag_ptrs: int64 tensors of every rank's buffer (≥ x.numel() elements of x's dtype)
    and flag buffer (2 × max_programs × world_size int32, zero before the first call) addresses as
    this rank maps them; stop: an int32 tensor, 0 unless the waits are called off. Every rank must
    pass the same max_programs.
    """
    n = x.numel()
    grid = (min(max_programs, triton.cdiv(n, BLOCK)),)
    _one_shot_all_reduce[grid](x, out, buf_ptrs, flag_ptrs, stop, n, rank,
                               W=world_size, BLOCK=BLOCK, PROGRAMS=max_programs, num_warps=WARPS)
