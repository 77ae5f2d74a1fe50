"""Structured output's allowed-token bitmask: filled on the host by the engine (MaskBuilder, with
engine/sampling/grammar.py's matchers) while the device runs the step's forward pass, then on the runner's side
copied in one transfer and applied to the logits before sampling, after the adjustments of
engine/sampling/penalties.py (engine/sampling/sampler.py calls these).

A batch without a constrained row has no GrammarRows, and its step runs as it would without this module.
"""
from __future__ import annotations

import functools
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from engine.runner import GrammarMasks
from engine.sampling import penalties
from engine.sampling.grammar import MaskFiller
from engine.sampling.pinned import PinnedRing


@dataclass
class GrammarRows:
    """A batch's constrained rows on the runner's side: `index` of them in the batch's sampled rows (on the
    host and the device); `bitmask` [R, ceil(V / 32)] int32, this step's on the device, set by upload()."""
    index: list[int]
    rows: torch.Tensor
    bitmask: torch.Tensor | None = None


def grammar_rows(index: list[int], device: torch.device) -> GrammarRows | None:
    """The constrained rows of a batch (their indices in its sampled rows), or None if there is none."""
    if not index:
        return None
    return GrammarRows(index, penalties.on_device(index, torch.int64, device))


def upload(g: GrammarRows, masks: GrammarMasks) -> None:
    """Queue the copy of the step's masks to the device (one copy)."""
    if masks.ring.device.type == "cuda":
        g.bitmask = masks.bitmask.to(masks.ring.device, non_blocking=True)
        masks.ring.copied(masks.slot)
    else:
        g.bitmask = masks.bitmask


class MaskBuilder:
    """The engine's side: a step's masks computed on the host, into buffers on their way to the device."""

    def __init__(self, vocab_size: int, device: torch.device):
        self.vocab_size = vocab_size
        self.filler = MaskFiller()
        self.ring = PinnedRing(device)  # the masks' host buffers, each reused once its copy is done

    def start(self, seqs: list, index: list[int]) -> _PendingMasks:
        """Begin the masks of the constrained rows `index` of the sampled sequences `seqs`, once every
        token before them has resolved: each live row's grammar follows its completion, then llguidance
        computes the masks into a host buffer (in MaskFiller.CALLS calls, each for a part of the rows, begun
        before the next part follows) on threads of their own while the caller goes on. A row finished
        meanwhile (its token will be dropped), or whose grammar refused its last token (its request fails
        as the token is processed), allows every token."""
        words = (self.vocab_size + 31) // 32
        slot, host = self.ring.take((len(index), words), torch.int32)
        pending = []
        # one part per call the filler keeps in flight, the first's masks computed while the next follows; by
        # start matcher, so that the calls never wait on each other's matchers' locks
        parts = [[] for _ in range(self.filler.CALLS)]
        for row, i in enumerate(index):
            parts[seqs[i].grammar.template % self.filler.CALLS].append(row)
        for rows in parts:
            live = []
            for row in rows:
                seq = seqs[index[row]]
                if not seq.is_finished:
                    try:
                        seq.grammar.follow(seq.completion_token_ids)
                    except ValueError:
                        pass  # follow() raises again where the step's tokens are processed, and fails the request
                    else:
                        if not seq.grammar.done:
                            live.append((seq.grammar, row))
                            continue
                host[row].fill_(-1)
            future = self.filler.start(live, host.data_ptr(), words * 4, len(index))
            if future is not None:
                pending.append(future)
        return _PendingMasks(GrammarMasks(host, self.ring, slot), pending)

    @staticmethod
    def finish(pending: _PendingMasks) -> GrammarMasks:
        """Wait for the masks start() began."""
        for future in pending.futures:
            future.result()
        return pending.masks


@dataclass
class _PendingMasks:
    masks: GrammarMasks
    futures: list[Future] = field(default_factory=list)


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
