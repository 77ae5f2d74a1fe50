"""Repetition, frequency and presence penalties on the device: one pass over the penalised rows' float32
logits, in place, reading each row's token counts and prompt tokens (engine/sampling/penalties.py's
TokenCounts) beside them, where torch ops take a dozen passes and temporaries of the rows' size.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 2048


@triton.jit
def _penalty_kernel(logits_ptr, rows_ptr, slots_ptr, counts_ptr, prompt_ptr, rep_ptr, freq_ptr, pres_ptr,
                    stride_row, counts_stride, prompt_stride, vocab, BLOCK: tl.constexpr):
    p = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < vocab
    row = tl.load(rows_ptr + p).to(tl.int64)
    slot = tl.load(slots_ptr + p).to(tl.int64)
    rep, freq, pres = tl.load(rep_ptr + p), tl.load(freq_ptr + p), tl.load(pres_ptr + p)
    out = logits_ptr + row * stride_row + cols
    x = tl.load(out, mask=inside, other=0.0)
    count = tl.load(counts_ptr + slot * counts_stride + cols, mask=inside, other=0)
    in_prompt = tl.load(prompt_ptr + slot * prompt_stride + cols, mask=inside, other=0)
    generated = count > 0
    seen = generated | (in_prompt != 0)
    x = tl.where(seen, tl.where(x < 0, x * rep, tl.div_rn(x, rep)), x)  # div_rn: torch's IEEE division
    x = x - freq * count.to(tl.float32) - tl.where(generated, pres, 0.0)
    tl.store(out, x, mask=inside)


def apply_penalties(logits: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor, counts: torch.Tensor,
                    in_prompt: torch.Tensor, repetition: torch.Tensor, frequency: torch.Tensor,
                    presence: torch.Tensor) -> None:
    """In place, for each p: row rows[p] of float32 logits [S, V] (unit column stride) penalised by row
    slots[p] of counts [N, V] int32 and in_prompt [N, V] bool, with repetition / frequency / presence [P]
    (or [P, 1]) float32; the order and semantics of engine/sampling/penalties.py's apply."""
    assert logits.dtype == torch.float32 and logits.dim() == 2 and logits.stride(1) == 1
    assert counts.dtype == torch.int32 and counts.stride(1) == 1 and in_prompt.stride(1) == 1
    vocab = logits.shape[1]
    if rows.numel() == 0 or vocab == 0:
        return
    grid = (rows.numel(), triton.cdiv(vocab, BLOCK))
    _penalty_kernel[grid](logits, rows, slots, counts, in_prompt.view(torch.uint8), repetition.contiguous(),
                          frequency.contiguous(), presence.contiguous(), logits.stride(0), counts.stride(0),
                          in_prompt.stride(0), vocab, BLOCK=BLOCK, num_warps=8)
