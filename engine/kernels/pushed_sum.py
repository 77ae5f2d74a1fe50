"""The receiving half of the large all-reduces whose parts the copy engines carry (prefill steps).

A rank's part of a row-parallel projection is computed in row chunks; after each chunk the copy engine
(not the SMs, which the next chunk's GEMM keeps busy) copies it into this rank's slot of every peer's
buffer and then writes the call's number into the peer's flag for (chunk, sender). This kernel, on the
receiving rank, waits until every peer's flag for its row's chunk holds the current call (or a later
one), sums the parts in rank order (fp32, rounded once: for two ranks exactly NCCL's bf16 sum, and the
same bits on every rank) and, with NORM, adds the residual and applies the RMSNorm with the roundings of
engine/layers/fusion.add_rms_norm.

Flags only grow (a call's number is larger than every earlier call's), so a flag already past the
current call also means its chunk has arrived. Why the slots a call reads are not overwritten while it
reads them: see engine/layers/parallel.CopyEngineSum. Every wait also polls a stop flag, which the
engine sets when a rank dies, so a dead peer cannot hang this kernel.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.common import round_to, row_warps


@triton.jit
def _wait_for_chunk(flags_ptr, chunk, call, stop, rank, W: tl.constexpr):
    """Until every peer's flag for `chunk` holds `call` or more, or the stop flag is set. The atomic
    reads acquire: the chunk's data, written before its flag, is visible after them."""
    for q in tl.static_range(W):
        if q != rank:
            flag = flags_ptr + chunk * W + q
            seen = tl.atomic_add(flag, 0, sem="acquire", scope="sys")
            halted = tl.load(stop, volatile=True)
            while (seen < call) & (halted == 0):
                seen = tl.atomic_add(flag, 0, sem="acquire", scope="sys")
                halted = tl.load(stop, volatile=True)


@triton.jit(do_not_specialize=["rows", "chunk_rows", "call", "rank"])
def _pushed_sum(x_ptr, residual_ptr, weight_ptr, out_ptr, slots_ptr, flags_ptr, stop,
                rows, hidden, chunk_rows, slot_elements, call, eps, rank,
                W: tl.constexpr, BLOCK: tl.constexpr, NORM: tl.constexpr):
    row = tl.program_id(0)
    dtype = x_ptr.dtype.element_ty
    _wait_for_chunk(flags_ptr, row // chunk_rows, call, stop, rank, W)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    offs = row.to(tl.int64) * hidden + cols
    total = tl.zeros([BLOCK], dtype=tl.float32)
    for q in tl.static_range(W):
        if q == rank:
            part = tl.load(x_ptr + offs, mask=mask, other=0.0)
        else:  # slots hold the peers' parts in rank order, this rank's own left out
            slot = q - (q > rank).to(tl.int32)
            part = tl.load(slots_ptr + slot * slot_elements + offs, mask=mask, other=0.0, volatile=True)
        total += part.to(tl.float32)
    reduced = round_to(total, dtype)  # rounded on the bits: see round_to
    if NORM:
        h = round_to(reduced + tl.load(residual_ptr + offs, mask=mask, other=0.0).to(tl.float32), dtype)
        tl.store(residual_ptr + offs, h.to(dtype), mask=mask)
        inv = tl.math.rsqrt(tl.sum(h * h, axis=0) / hidden + eps)
        weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + offs, round_to(weight * round_to(h * inv, dtype), dtype).to(dtype), mask=mask)
    else:
        tl.store(out_ptr + offs, reduced.to(dtype), mask=mask)


def pushed_sum(x: torch.Tensor, slots: torch.Tensor, flags: torch.Tensor, stop: torch.Tensor, call: int,
               chunk_rows: int, rank: int, world_size: int, out: torch.Tensor | None = None,
               residual: torch.Tensor | None = None, weight: torch.Tensor | None = None,
               eps: float = 0.0) -> torch.Tensor:
    """The sum over ranks of a [rows, hidden] part, once the peers' parts have arrived in `slots`.

    x: this rank's part (contiguous). slots: this rank's buffer for the call's generation, the peers'
    parts one after another in rank order (world_size - 1 slots of slots.numel() // (world_size - 1)
    elements; this rank's own is left out). flags: int32 [chunks * world_size], flags[c * world_size + q]
    the last call whose chunk c (rows c * chunk_rows ...) peer q delivered. stop: int32, nonzero to
    call off the waits. With residual and weight: residual ← sum + residual, returns rms_norm(residual)
    × weight (both written in place, into out if given, else over x); otherwise returns the sum.
    """
    rows, hidden = x.shape
    assert x.is_contiguous() and slots.dtype == x.dtype and flags.dtype == torch.int32
    slot_elements = slots.numel() // max(1, world_size - 1)
    assert x.numel() <= slot_elements, f"a part of {x.numel()} elements; slots hold {slot_elements}"
    norm = residual is not None
    if norm:
        assert residual.shape == x.shape and residual.is_contiguous() and weight.shape == (hidden,)
    out = x if out is None else out
    block = triton.next_power_of_2(hidden)
    if rows:
        _pushed_sum[(rows,)](
            x, residual if norm else x, weight if norm else x, out, slots, flags, stop,
            rows, hidden, chunk_rows, slot_elements, call, eps, rank,
            W=world_size, BLOCK=block, NORM=norm, num_warps=row_warps(block))
    return out
