"""One-shot all-reduce over buffers every rank maps (symmetric memory), whose waits can be called off.

Push, then sum locally, with the data as its own signal. Each rank's buffer holds GENERATIONS sets of
one slot per rank, and every element of a free slot holds a sentinel (the bit pattern of -0.0). A call
stores this rank's input, with any -0.0 written as +0.0, straight into slot `rank` of the current
generation of every peer's buffer (remote stores, which NVLink posts and pipelines). Then it reads its
own buffer's slots until no element holds the sentinel any more: those elements are the peers' parts,
arrived. It sums the parts in rank order (fp32, rounded once: for two ranks exactly NCCL's bf16 sum) and
writes the sentinel back over the slots it read. No flags and no meetings: a call costs one one-way
trip over NVLink.

Why a slot is free again when a peer next stores into it. Calls rotate through the generations, so a
peer stores into this generation again only GENERATIONS calls later; by then it has finished the call in
between, which needed this rank's part of that call, which this rank stored only after its kernel of
this call (which cleared the slots) had ended. Two generations would do; three leave a margin.

Every rank must agree on the current generation without talking: each program keeps its own count of
calls in `state[pid]` (this rank's memory), every call launches the same PROGRAMS programs on every
rank, and program p of every rank handles the same elements (blocks, or rows for the fused kernel,
strided by PROGRAMS). So program p of each rank is at the same count, and program p's slots of one
generation are cleared by program p alone.

Every wait also polls a stop flag in this rank's device memory. A rank that dies mid-step leaves its
peers' programs waiting for data that never comes, and no communicator abort reaches them; setting the
flag (from a side stream, which never queues behind them) makes them return, with meaningless results,
so the engine can stop instead of hanging. The buffers are then left dirty: the engine stops anyway.

Also here: the all-reduce fused with the residual add and RMSNorm that follow it in a decoder layer
(one_shot_all_reduce_add_rms_norm), rows strided over the programs.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.common import round_to, row_warps

BLOCK = 4096        # elements per program and loop step: 16 a thread, two 16-byte accesses
WARPS = 8
PROGRAMS = 128      # the grid of every call (state holds a counter per program); 256 measured the same (adf9dfa)
MAX_HIDDEN = 16384  # widest row the fused kernel holds in one program
SLOT_ALIGN = 16     # slots start at multiples of 16 elements, so their accesses are vectorised
GENERATIONS = 3     # buffer sets a rank cycles through, one per call


def slot_size(n: int) -> int:
    """Elements between two ranks' slots in a buffer, for n-element parts."""
    return triton.cdiv(n, SLOT_ALIGN) * SLOT_ALIGN


def buffer_elements(capacity: int, world_size: int) -> int:
    """Elements of a rank's buffer that takes parts of up to `capacity` elements."""
    return GENERATIONS * world_size * slot_size(capacity)


def _bits_dtype(dtype: torch.dtype) -> torch.dtype:
    if dtype.itemsize not in (2, 4):
        raise ValueError(f"the one-shot all-reduce takes 2- or 4-byte floats, not {dtype}")
    return torch.int16 if dtype.itemsize == 2 else torch.int32


def _bits(dtype: torch.dtype) -> dict:
    """The kernels' BITS and SENTINEL: integers of the element's width, and -0.0's bits among them."""
    bits = _bits_dtype(dtype)
    return {"BITS": tl.int16 if bits == torch.int16 else tl.int32, "SENTINEL": torch.iinfo(bits).min}


def clear_buffer(buffer: torch.Tensor) -> torch.Tensor:
    """Fill a fresh buffer with the sentinel (-0.0), as every slot must hold before its first call."""
    bits = _bits_dtype(buffer.dtype)
    return buffer.view(bits).fill_(torch.iinfo(bits).min)


@triton.jit
def _slots(buf_ptrs, q, generation, slot, W: tl.constexpr, BITS: tl.constexpr):
    """Slot 0 of this call's generation in rank q's buffer, as this rank maps it, as bits."""
    base = tl.load(buf_ptrs + q).to(tl.pointer_type(BITS))
    return tl.multiple_of(base + generation * W * slot, 16)


@triton.jit
def _own_part(x_ptr, offs, mask, BITS: tl.constexpr, SENTINEL: tl.constexpr):
    """This rank's part as bits, any -0.0 made +0.0 (the sentinel never travels; every rank sums the
    same bits)."""
    bits = tl.load(x_ptr.to(tl.pointer_type(BITS)) + offs, mask=mask, other=0)
    return tl.where(bits == SENTINEL, tl.zeros_like(bits), bits)


@triton.jit
def _push(x_ptr, buf_ptrs, offs, mask, generation, slot, rank,
          W: tl.constexpr, BITS: tl.constexpr, SENTINEL: tl.constexpr):
    """Store x[offs] into slot `rank` of this generation in every peer's buffer."""
    part = _own_part(x_ptr, offs, mask, BITS, SENTINEL)
    for q in tl.static_range(W):
        if q != rank:
            tl.store(_slots(buf_ptrs, q, generation, slot, W, BITS) + rank * slot + offs, part, mask=mask)


@triton.jit
def _arrived(slot_bits, offs, mask, stop, SENTINEL: tl.constexpr):
    """A peer's part at offs once every element has arrived (or the stop flag is set)."""
    bits = tl.load(slot_bits + offs, mask=mask, other=0, volatile=True)
    missing = tl.sum((bits == SENTINEL).to(tl.int32), axis=0)
    halted = tl.load(stop, volatile=True)
    while (missing > 0) & (halted == 0):
        bits = tl.load(slot_bits + offs, mask=mask, other=0, volatile=True)
        missing = tl.sum((bits == SENTINEL).to(tl.int32), axis=0)
        halted = tl.load(stop, volatile=True)
    return bits


@triton.jit
def _rank_order_sum(x_ptr, buf_ptrs, offs, mask, generation, slot, rank, stop,
                    W: tl.constexpr, BITS: tl.constexpr, SENTINEL: tl.constexpr):
    """fp32 sum over ranks of their parts at offs (each peer's waited for in this rank's buffer, then
    its slot cleared again)."""
    dtype = x_ptr.dtype.element_ty
    own = _slots(buf_ptrs, rank, generation, slot, W, BITS)
    cleared = tl.full(offs.shape, SENTINEL, BITS)
    total = tl.zeros(offs.shape, dtype=tl.float32)
    for q in tl.static_range(W):
        if q == rank:
            bits = _own_part(x_ptr, offs, mask, BITS, SENTINEL)
        else:
            bits = _arrived(own + q * slot, offs, mask, stop, SENTINEL)
            tl.store(own + q * slot + offs, cleared, mask=mask)
        total += bits.to(dtype, bitcast=True).to(tl.float32)
    return total


@triton.jit(do_not_specialize=["n", "rank"])  # one compiled kernel for every rank and size
def _one_shot_all_reduce(x_ptr, out_ptr, buf_ptrs, state, stop, n, slot, rank,
                         W: tl.constexpr, BLOCK: tl.constexpr, GENERATIONS: tl.constexpr,
                         BITS: tl.constexpr, SENTINEL: tl.constexpr):
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    dtype = x_ptr.dtype.element_ty
    calls = tl.load(state + pid)
    generation = calls % GENERATIONS
    cols = tl.arange(0, BLOCK)
    whole = cols < BLOCK  # blocks below `full` need no bounds: their accesses are vectorised
    full = n // BLOCK * BLOCK
    has_tail = (pid == (n // BLOCK) % programs) & (full < n)  # block n // BLOCK's owner, as in the loop
    for start in range(pid * BLOCK, full, programs * BLOCK):
        _push(x_ptr, buf_ptrs, start + cols, whole, generation, slot, rank, W, BITS, SENTINEL)
    if has_tail:
        _push(x_ptr, buf_ptrs, full + cols, full + cols < n, generation, slot, rank, W, BITS, SENTINEL)
    # in place is safe: each element of x is read before its program writes it, and peers never read x
    for start in range(pid * BLOCK, full, programs * BLOCK):
        offs = start + cols
        total = _rank_order_sum(x_ptr, buf_ptrs, offs, whole, generation, slot, rank, stop, W, BITS, SENTINEL)
        tl.store(out_ptr + offs, round_to(total, dtype).to(dtype))  # rounded on the bits: see round_to
    if has_tail:
        offs = full + cols
        total = _rank_order_sum(x_ptr, buf_ptrs, offs, offs < n, generation, slot, rank, stop, W, BITS, SENTINEL)
        tl.store(out_ptr + offs, round_to(total, dtype).to(dtype), mask=offs < n)
    tl.store(state + pid, calls + 1)


@triton.jit(do_not_specialize=["rows", "rank"])
def _one_shot_all_reduce_add_rms_norm(x_ptr, residual_ptr, weight_ptr, out_ptr, buf_ptrs, state, stop,
                                      rows, hidden, slot, eps, rank,
                                      W: tl.constexpr, BLOCK: tl.constexpr, GENERATIONS: tl.constexpr,
                                      BITS: tl.constexpr, SENTINEL: tl.constexpr):
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    dtype = x_ptr.dtype.element_ty
    calls = tl.load(state + pid)
    generation = calls % GENERATIONS
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    for row in range(pid, rows, programs):
        _push(x_ptr, buf_ptrs, row * hidden + cols, mask, generation, slot, rank, W, BITS, SENTINEL)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)  # arrives during the wait
    for row in range(pid, rows, programs):
        offs = row * hidden + cols
        total = _rank_order_sum(x_ptr, buf_ptrs, offs, mask, generation, slot, rank, stop, W, BITS, SENTINEL)
        reduced = round_to(total, dtype)
        # rounded as engine/layers/fusion.add_rms_norm: the residual sum, the normalised row, the product
        h = round_to(reduced + tl.load(residual_ptr + offs, mask=mask, other=0.0).to(tl.float32), dtype)
        tl.store(residual_ptr + offs, h.to(dtype), mask=mask)
        inv = tl.math.rsqrt(tl.sum(h * h, axis=0) / hidden + eps)
        tl.store(out_ptr + offs, round_to(weight * round_to(h * inv, dtype), dtype).to(dtype), mask=mask)
    tl.store(state + pid, calls + 1)


def one_shot_all_reduce(x, out, buf_ptrs, state, stop, rank: int, world_size: int,
                        programs: int = PROGRAMS) -> None:
    """out = the sum over ranks of each rank's x (contiguous, same shape and dtype on every rank; out
    may be x).

    buf_ptrs: an int64 tensor of every rank's buffer address as this rank maps it (each buffer ≥
    buffer_elements(x.numel(), world_size) elements of x's dtype, 16-byte aligned, filled by
    clear_buffer before the first call); state: int32 [programs] in this rank's memory, zero before the
    first call; stop: an int32 tensor, 0 unless the waits are called off. Every rank must make the same
    sequence of calls (of either kernel) with the same `programs`.
    """
    n = x.numel()
    _one_shot_all_reduce[(programs,)](
        x, out, buf_ptrs, state, stop, n, slot_size(n), rank,
        W=world_size, BLOCK=BLOCK, GENERATIONS=GENERATIONS, **_bits(x.dtype), num_warps=WARPS)


def one_shot_all_reduce_add_rms_norm(x, residual, weight, eps: float, out, buf_ptrs, state, stop, rank: int,
                                     world_size: int, programs: int = PROGRAMS) -> None:
    """With s the sum over ranks of each rank's x: residual ← s + residual, out ← rms_norm(residual) ×
    weight, rounded as engine/layers/fusion.add_rms_norm rounds, identical on every rank.

    x, residual, out: contiguous [rows, hidden] (hidden ≤ MAX_HIDDEN; out may be x); weight: [hidden];
    one dtype for all. The other arguments as in one_shot_all_reduce, for x.numel() elements.
    """
    rows, hidden = x.shape
    assert hidden <= MAX_HIDDEN, f"rows of {hidden} elements; at most {MAX_HIDDEN}"
    block = triton.next_power_of_2(hidden)
    _one_shot_all_reduce_add_rms_norm[(programs,)](
        x, residual, weight, out, buf_ptrs, state, stop, rows, hidden, slot_size(x.numel()), eps, rank,
        W=world_size, BLOCK=block, GENERATIONS=GENERATIONS, **_bits(x.dtype), num_warps=row_warps(block))
