"""One-shot all-reduce over buffers every rank maps (symmetric memory), whose waits can be called off.

Push, then sum locally. Each rank's buffer holds one slot per rank. Each program owns a strided share
of the elements: it stores its share of this rank's input straight into slot `rank` of every peer's
buffer, signals every peer, waits for every peer's signal, then sums in rank order (fp32, rounded once:
for two ranks exactly NCCL's bf16 sum), reading this rank's part from its own input and each peer's
part from that peer's slot in its own buffer. Remote traffic is only stores, which NVLink posts and
pipelines; every load is local. A last meeting before the program returns keeps a rank's next call
from overwriting a slot a peer still reads. A signal is a flag in the receiver's flag buffer, set to 1
by the sender (a release exchange whose reply nobody waits for) and taken 1 → 0 by the receiver;
program p only meets program p of each peer (same grid on every rank), so the programs of one GPU never
wait on each other.

Memory ordering. Sender: every thread's stores into peer buffers, then a CTA barrier, then one thread
sets the peer's flag with a release atomic at system scope. The barrier orders the other threads'
stores before that thread's atomic, and a release is cumulative, so the peer that acquires the flag
(acq_rel atomic at system scope, then a CTA barrier before any thread loads) sees every store of the
share; slot loads also bypass L1 (`.cv`), so no line cached by an earlier call is read. The last
meeting orders each program's slot loads before its (release) signal, and a peer's next kernel, which
stores into those slots, starts only after every program of the peer's current one took that signal.

Every wait also polls a stop flag in this rank's device memory. A rank that dies mid-step leaves its
peers' programs waiting on a signal that never comes, and no communicator abort reaches them; setting
the flag (from a side stream, which never queues behind them) makes them return, with meaningless
results, so the engine can stop instead of hanging.

Also here: the all-reduce fused with the residual add and RMSNorm that follow it in a decoder layer
(one_shot_all_reduce_add_rms_norm), one program per row at a time.
"""
from __future__ import annotations

import triton
import triton.language as tl

from engine.kernels.norm_act import _warps
from engine.kernels.qkv_prep import _round

BLOCK = 4096        # elements per program and loop step: 16 a thread, two 16-byte accesses
WARPS = 8
MAX_PROGRAMS = 128  # flags are laid out for this many programs; see _programs
MAX_HIDDEN = 16384  # widest row the fused kernel holds in one program
SLOT_ALIGN = 16     # slots start at multiples of 16 elements, so their accesses are vectorised


def slot_size(n: int) -> int:
    """Elements between two ranks' slots in a buffer, for n-element parts."""
    return triton.cdiv(n, SLOT_ALIGN) * SLOT_ALIGN


def _programs(n: int, max_programs: int) -> int:
    """The grid: one program per BLOCK elements, at most max_programs, each looping over its blocks.

    A program keeps one block in flight per loop step, so a step of 128 programs moves 1 MB of bf16,
    above NVLink's bandwidth-delay product (~450 GB/s × ~1 µs): 2 MB takes two steps. Up to 1 MB every
    program runs one step, and the cost is the flag round trips, which more programs would not shorten
    (each program's meeting runs alongside the others'). 128 programs of 8 warps stay resident together
    on an H100/H200 (132 SMs), which the waits need: program p spins until program p of each peer runs.
    """
    return min(max_programs, triton.cdiv(n, BLOCK))


@triton.jit
def _swap_flag(flag, expected, new, stop):
    """Set *flag from `expected` to `new` once it holds `expected`; give up when *stop is set."""
    old = tl.atomic_cas(flag, expected, new, sem="acq_rel", scope="sys")
    # read by one thread and shared, like `old`, so every thread leaves the loop together
    halted = tl.atomic_add(stop, 0, sem="relaxed", scope="gpu")
    while (old != expected) & (halted == 0):
        old = tl.atomic_cas(flag, expected, new, sem="acq_rel", scope="sys")
        halted = tl.atomic_add(stop, 0, sem="relaxed", scope="gpu")


@triton.jit
def _meet_peers(flag_ptrs, phase, rank, stop, W: tl.constexpr, PROGRAMS: tl.constexpr):
    """Signal program `pid` of every peer, then wait for each one's signal (flags [2, PROGRAMS, W])."""
    pid = tl.program_id(0)
    slot = (phase * PROGRAMS + pid) * W
    tl.debug_barrier()  # every thread's stores and loads come before the signal that publishes them
    for q in tl.static_range(W):
        if q != rank:
            # a posted store, not a swap: the flag is 0 by now (the peer took this phase's last signal
            # before it could signal the meeting that follows it), and nothing waits for the reply
            peer_flags = tl.load(flag_ptrs + q).to(tl.pointer_type(tl.int32))
            tl.atomic_xchg(peer_flags + slot + rank, 1, sem="release", scope="sys")
    own_flags = tl.load(flag_ptrs + rank).to(tl.pointer_type(tl.int32))
    for q in tl.static_range(W):
        if q != rank:
            _swap_flag(own_flags + slot + q, 1, 0, stop)
    tl.debug_barrier()  # no thread reads a slot before the signal that published it


@triton.jit
def _buffer(buf_ptrs, q, dtype: tl.constexpr):
    """Rank q's buffer as this rank maps it (allocations are at least 16-byte aligned)."""
    return tl.multiple_of(tl.load(buf_ptrs + q).to(tl.pointer_type(dtype)), 16)


@triton.jit
def _push(x_ptr, buf_ptrs, offs, mask, slot, rank, W: tl.constexpr):
    """Store x[offs] into slot `rank` of every peer's buffer."""
    part = tl.load(x_ptr + offs, mask=mask)
    for q in tl.static_range(W):
        if q != rank:
            peer = _buffer(buf_ptrs, q, x_ptr.dtype.element_ty)
            tl.store(peer + rank * slot + offs, part, mask=mask)


@triton.jit
def _rank_order_sum(x_ptr, own, offs, mask, slot, rank, W: tl.constexpr):
    """fp32 sum over ranks of their parts at offs: this rank's from x, each peer's from its slot."""
    total = tl.zeros(offs.shape, dtype=tl.float32)
    for q in tl.static_range(W):
        part = tl.where(q == rank, x_ptr, own + q * slot)
        total += tl.load(part + offs, mask=mask, other=0.0, cache_modifier=".cv").to(tl.float32)
    return total


@triton.jit(do_not_specialize=["n", "rank"])  # one compiled kernel for every rank and size
def _one_shot_all_reduce(x_ptr, out_ptr, buf_ptrs, flag_ptrs, stop, n, slot, rank,
                         W: tl.constexpr, BLOCK: tl.constexpr, PROGRAMS: tl.constexpr):
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    dtype = x_ptr.dtype.element_ty
    cols = tl.arange(0, BLOCK)
    whole = cols < BLOCK  # blocks below `full` need no bounds: their accesses are vectorised
    full = n // BLOCK * BLOCK
    has_tail = (pid == (n // BLOCK) % programs) & (full < n)  # block n // BLOCK's owner, as in the loop
    for start in range(pid * BLOCK, full, programs * BLOCK):
        _push(x_ptr, buf_ptrs, start + cols, whole, slot, rank, W)
    if has_tail:
        _push(x_ptr, buf_ptrs, full + cols, full + cols < n, slot, rank, W)
    _meet_peers(flag_ptrs, 0, rank, stop, W, PROGRAMS)
    own = _buffer(buf_ptrs, rank, dtype)
    # in place is safe: each element of x is read before its program writes it, and peers never read x
    for start in range(pid * BLOCK, full, programs * BLOCK):
        offs = start + cols
        total = _rank_order_sum(x_ptr, own, offs, whole, slot, rank, W)
        tl.store(out_ptr + offs, _round(total, dtype).to(dtype))  # rounded on the bits: see _round
    if has_tail:
        offs = full + cols
        total = _rank_order_sum(x_ptr, own, offs, offs < n, slot, rank, W)
        tl.store(out_ptr + offs, _round(total, dtype).to(dtype), mask=offs < n)
    _meet_peers(flag_ptrs, 1, rank, stop, W, PROGRAMS)


@triton.jit(do_not_specialize=["rows", "rank"])
def _one_shot_all_reduce_add_rms_norm(x_ptr, residual_ptr, weight_ptr, out_ptr, buf_ptrs, flag_ptrs, stop,
                                      rows, hidden, slot, eps, rank,
                                      W: tl.constexpr, BLOCK: tl.constexpr, PROGRAMS: tl.constexpr):
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    dtype = x_ptr.dtype.element_ty
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    for row in range(pid, rows, programs):
        _push(x_ptr, buf_ptrs, row * hidden + cols, mask, slot, rank, W)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)  # arrives during the wait
    _meet_peers(flag_ptrs, 0, rank, stop, W, PROGRAMS)
    own = _buffer(buf_ptrs, rank, dtype)
    for row in range(pid, rows, programs):
        offs = row * hidden + cols
        reduced = _round(_rank_order_sum(x_ptr, own, offs, mask, slot, rank, W), dtype)
        # rounded as engine/layers/fusion.add_rms_norm: the residual sum, the normalised row, the product
        h = _round(reduced + tl.load(residual_ptr + offs, mask=mask, other=0.0).to(tl.float32), dtype)
        tl.store(residual_ptr + offs, h.to(dtype), mask=mask)
        inv = tl.math.rsqrt(tl.sum(h * h, axis=0) / hidden + eps)
        tl.store(out_ptr + offs, _round(weight * _round(h * inv, dtype), dtype).to(dtype), mask=mask)
    _meet_peers(flag_ptrs, 1, rank, stop, W, PROGRAMS)


def one_shot_all_reduce(x, out, buf_ptrs, flag_ptrs, stop, rank: int, world_size: int,
                        max_programs: int = MAX_PROGRAMS) -> None:
    """out = the sum over ranks of each rank's x (contiguous, same shape and dtype on every rank; out
    may be x).

    buf_ptrs / flag_ptrs: int64 tensors of every rank's buffer (≥ world_size × slot_size(x.numel())
    elements of x's dtype, 16-byte aligned) and flag buffer (2 × max_programs × world_size int32, zero
    before the first call) addresses as this rank maps them; stop: an int32 tensor, 0 unless the waits
    are called off. Every rank must pass the same max_programs.
    """
    n = x.numel()
    if n:
        _one_shot_all_reduce[(_programs(n, max_programs),)](
            x, out, buf_ptrs, flag_ptrs, stop, n, slot_size(n), rank,
            W=world_size, BLOCK=BLOCK, PROGRAMS=max_programs, num_warps=WARPS)


def one_shot_all_reduce_add_rms_norm(x, residual, weight, eps: float, out, buf_ptrs, flag_ptrs, stop, rank: int,
                                     world_size: int, max_programs: int = MAX_PROGRAMS) -> None:
    """With s the sum over ranks of each rank's x: residual ← s + residual, out ← rms_norm(residual) ×
    weight, rounded as engine/layers/fusion.add_rms_norm rounds, identical on every rank.

    x, residual, out: contiguous [rows, hidden] (hidden ≤ MAX_HIDDEN; out may be x); weight: [hidden];
    one dtype for all. The other arguments as in one_shot_all_reduce, for x.numel() elements.
    """
    rows, hidden = x.shape
    assert hidden <= MAX_HIDDEN, f"rows of {hidden} elements; at most {MAX_HIDDEN}"
    if rows:
        block = triton.next_power_of_2(hidden)
        _one_shot_all_reduce_add_rms_norm[(min(rows, max_programs),)](
            x, residual, weight, out, buf_ptrs, flag_ptrs, stop, rows, hidden, slot_size(x.numel()), eps, rank,
            W=world_size, BLOCK=block, PROGRAMS=max_programs, num_warps=_warps(block))
