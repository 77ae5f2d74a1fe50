"""Structured output's mask on the device: every token a row's grammar disallows set to -inf in its logits,
in place, from the row's bitmask (one bit a token id, least significant first in int32 words, as llguidance
writes it). One pass over the constrained rows' logits, whatever their dtype; only the disallowed columns
are written.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit
def _mask_kernel(logits_ptr, mask_ptr, rows_ptr, stride_row, mask_stride, vocab, BLOCK: tl.constexpr):
    r = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < vocab
    row = tl.load(rows_ptr + r)
    words = tl.load(mask_ptr + r * mask_stride + cols // 32, mask=inside, other=-1)
    allowed = ((words >> (cols % 32)) & 1) != 0  # an arithmetic shift: bit 31 still lands in bit 0
    out = logits_ptr + row.to(tl.int64) * stride_row + cols
    tl.store(out, tl.full([BLOCK], float("-inf"), out.dtype.element_ty), mask=inside & ~allowed)


def mask_logits(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """In place: logits[rows[r], t] = -inf wherever bit t of bitmask[r] is 0. logits [S, V] (unit column
    stride), bitmask [R, >= ceil(V / 32)] int32, rows [R] int64 on the logits' device."""
    assert logits.dim() == 2 and logits.stride(1) == 1, "logits [S, V] with unit column stride"
    assert bitmask.dtype == torch.int32 and bitmask.stride(1) == 1 and bitmask.shape[0] == rows.shape[0]
    vocab = logits.shape[1]
    assert bitmask.shape[1] * 32 >= vocab, "a bit for every column"
    if rows.numel() == 0 or vocab == 0:
        return
    _mask_kernel[(rows.numel(), triton.cdiv(vocab, BLOCK))](logits, bitmask, rows, logits.stride(0),
                                                             bitmask.stride(0), vocab, BLOCK=BLOCK, num_warps=4)
