"""Structured output on the device: a batch's constrained rows and their allowed-token bitmask, filled on
the host (engine/grammar.py), copied in one transfer and applied to the logits before sampling, after the
adjustments of engine/penalties.py. engine/sampler.py owns sampling and calls these; nothing else does.

A batch without a constrained row has no GrammarRows, and its step runs as it would without this module.
"""
from __future__ import annotations

import functools
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from engine import penalties
from engine.grammar import MaskFiller
from engine.pinned import PinnedRing


@dataclass
class GrammarRows:
    """A batch's constrained rows: `index` of them in the batch's sampled rows (on the host and the
    device); `bitmask` [R, ceil(V / 32)] int32, this step's on the device, set by finish()."""
    index: list[int]
    rows: torch.Tensor
    bitmask: torch.Tensor | None = None
    host: torch.Tensor | None = None   # this step's masks on the host, and their slot of the ring
    slot: int = 0
    pending: list[Future] = field(default_factory=list)  # the masks' computations, until finish()


def grammar_rows(seqs: list, device: torch.device) -> GrammarRows | None:
    """The constrained rows of a batch whose sampled sequences are `seqs`, or None if there is none."""
    index = [i for i, s in enumerate(seqs) if s.grammar is not None]
    if not index:
        return None
    return GrammarRows(index, penalties.on_device(index, torch.int64, device))


def start(g: GrammarRows, seqs: list, vocab_size: int, filler: MaskFiller, buffers: PinnedRing) -> None:
    """Begin this step's masks, every sampled token before it resolved: each live row's grammar follows
    its completion, then llguidance computes the masks into a host buffer (in MaskFiller.CALLS calls, each
    for a part of the rows, begun before the next part follows) on threads of their own while the caller
    goes on; finish() takes them to the device. A row finished meanwhile (its token will be dropped),
    or whose grammar refused its last token (its request fails as the token is processed), allows every token."""
    words = (vocab_size + 31) // 32
    g.slot, g.host = buffers.take((len(g.index), words), torch.int32)
    g.pending = []
    # one part per call the filler keeps in flight, the first's masks computed while the next follows; by
    # start matcher, so that the calls never wait on each other's matchers' locks
    parts = [[] for _ in range(filler.CALLS)]
    for row, i in enumerate(g.index):
        parts[seqs[i].grammar.template % filler.CALLS].append(row)
    for rows in parts:
        live = []
        for row in rows:
            seq = seqs[g.index[row]]
            if not seq.is_finished:
                try:
                    seq.grammar.follow(seq.completion_token_ids)
                except ValueError:
                    pass  # follow() raises again where the step's tokens are processed, and fails the request
                else:
                    if not seq.grammar.done:
                        live.append((seq.grammar, row))
                        continue
            g.host[row].fill_(-1)
        future = filler.start(live, g.host.data_ptr(), words * 4, len(g.index))
        if future is not None:
            g.pending.append(future)


def finish(g: GrammarRows, buffers: PinnedRing) -> None:
    """Wait for the masks start() began, and queue their copy to the device (one copy)."""
    for future in g.pending:
        future.result()
    g.pending = []
    if buffers.device.type == "cuda":
        g.bitmask = g.host.to(buffers.device, non_blocking=True)
        buffers.copied(g.slot)
    else:
        g.bitmask = g.host


def apply(logits: torch.Tensor, g: GrammarRows) -> None:
    """Mask to -inf, in place in logits [S, V], every token the grammar of a constrained row disallows: on
    a GPU with Triton one kernel (engine/kernels/token_mask.py), whatever the logits' dtype; else torch."""
    if in_place(logits):
        _mask_kernel()(logits, g.bitmask, g.rows)
        return
    vocab_size = logits.shape[1]
    # little-endian words, least significant bit first: byte by byte, bit by bit, token ids go in order
    shifts = torch.arange(8, dtype=torch.uint8, device=logits.device)
    bits = (g.bitmask.view(torch.uint8).unsqueeze(-1) >> shifts) & 1  # one byte a token, not four
    allowed = bits.flatten(1)[:, :vocab_size].bool()
    logits[g.rows] = logits[g.rows].masked_fill(~allowed, float("-inf"))


def in_place(logits: torch.Tensor) -> bool:
    """Whether apply() can mask these logits where they are (no float32 copy needed for the mask alone)."""
    return logits.is_cuda and _mask_kernel() is not None


@functools.cache
def _mask_kernel():
    try:
        from engine.kernels.token_mask import mask_logits
    except ImportError:  # no triton
        return None
    return mask_logits
