"""What a request may change in its logits before sampling: repetition, presence and frequency penalties,
logit biases and min_tokens. engine/sampling/sampler.py owns sampling and calls these; nothing else does.

Each penalised sequence has a row in two device tables, kept for its life (preemption included): how
often it generated each token, and which tokens its prompt holds. The step that samples its token adds
it to its row on the device, so the host never reads the counts back.

The order, for one row of float32 logits: the repetition penalty (transformers' semantics, over prompt
and generated tokens: a seen token's logit is divided by the penalty if positive, multiplied if not),
then the frequency and presence penalties (OpenAI's, over generated tokens: logit -= frequency * count
+ presence * (count > 0)), then the biases are added, then min_tokens masks the stop tokens to -inf.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch


@dataclass
class LogitAdjustments:
    """A batch's adjustments, as device tensors; rows are the batch's sampled rows."""
    rows: torch.Tensor | None          # [P] rows with a penalty
    slots: torch.Tensor | None         # [P] their rows of the TokenCounts tables
    repetition: torch.Tensor | None    # [P, 1] float32
    frequency: torch.Tensor | None     # [P, 1] float32
    presence: torch.Tensor | None      # [P, 1] float32
    bias_rows: torch.Tensor | None     # [B] (row, token, bias) triples
    bias_tokens: torch.Tensor | None
    bias_values: torch.Tensor | None
    has_min_tokens: bool               # a row's request has min_tokens (the engine checks it every step)
    suppressed: tuple[torch.Tensor, torch.Tensor] | None = None  # this step's (rows, tokens) masked to -inf


class TokenCounts:
    """Per penalised sequence, on the device: its generated tokens' counts and its prompt's tokens."""

    def __init__(self, device: torch.device, vocab_size: int):
        self.device, self.vocab_size = device, vocab_size
        self.counts = torch.zeros(0, vocab_size, dtype=torch.int32, device=device)
        self.in_prompt = torch.zeros(0, vocab_size, dtype=torch.bool, device=device)
        self.slot_of: dict[int, int] = {}  # seq_id -> row
        self.free_slots: list[int] = []

    def slot(self, seq_id: int, prompt_token_ids: list[int]) -> int:
        """Sequence `seq_id`'s row, taken (and cleared, its prompt entered) the first time it is asked for."""
        slot = self.slot_of.get(seq_id)
        if slot is not None:
            return slot
        if not self.free_slots:
            self._grow()
        slot = self.slot_of[seq_id] = self.free_slots.pop()
        self.counts[slot].zero_()
        self.in_prompt[slot].zero_()
        self.in_prompt[slot, on_device(prompt_token_ids, torch.int64, self.device)] = True
        return slot

    def release(self, seq_id: int) -> None:
        slot = self.slot_of.pop(seq_id, None)
        if slot is not None:
            self.free_slots.append(slot)

    def _grow(self) -> None:
        old = self.counts.shape[0]
        new = max(8, 2 * old)
        counts = torch.zeros(new, self.vocab_size, dtype=torch.int32, device=self.device)
        in_prompt = torch.zeros(new, self.vocab_size, dtype=torch.bool, device=self.device)
        counts[:old], in_prompt[:old] = self.counts, self.in_prompt
        self.counts, self.in_prompt = counts, in_prompt
        self.free_slots += range(new - 1, old - 1, -1)

    def add(self, adj: LogitAdjustments, token_ids: torch.Tensor) -> None:
        """Count each penalised row's sampled token (on the device)."""
        if adj.rows is None:
            return
        ones = torch.ones(len(adj.slots), dtype=torch.int32, device=self.device)
        self.counts.index_put_((adj.slots, token_ids[adj.rows]), ones, accumulate=True)


def on_device(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A tensor of `values` on the device, pinned and asynchronous (building it never waits for the GPU)."""
    t = torch.tensor(values, dtype=dtype)
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t


def adjustments(rows, counts: TokenCounts, device: torch.device) -> LogitAdjustments:
    """The adjustments of a batch whose sampled rows are `rows` (engine.runner.SamplingRows; at least one
    asks for one)."""
    def tensor(values, dtype):
        return on_device(values, dtype, device)

    index = slots = repetition = frequency = presence = None
    if rows.penalties:
        index = tensor([p[0] for p in rows.penalties], torch.int64)
        slots = tensor([counts.slot(rows.row_ids[p[0]], prompt) for p, prompt in zip(rows.penalties, rows.prompts)],
                       torch.int64)
        repetition, frequency, presence = (tensor([[p[k]] for p in rows.penalties], torch.float32) for k in (1, 2, 3))
    bias_rows = bias_tokens = bias_values = None
    if rows.biases:
        r, t, b = zip(*rows.biases)
        bias_rows, bias_tokens, bias_values = tensor(r, torch.int64), tensor(t, torch.int64), tensor(b, torch.float32)
    return LogitAdjustments(index, slots, repetition, frequency, presence, bias_rows, bias_tokens, bias_values,
                            rows.has_min_tokens)


def suppress(adj: LogitAdjustments, pairs: list[tuple[int, int]], device: torch.device) -> None:
    """This step's stop tokens to mask, (row, token) pairs: those of each row still short of its min_tokens."""
    if not pairs:
        adj.suppressed = None
        return
    rows, tokens = zip(*pairs)
    adj.suppressed = (on_device(rows, torch.int64, device), on_device(tokens, torch.int64, device))


def apply(logits: torch.Tensor, adj: LogitAdjustments, counts: TokenCounts) -> None:
    """Adjust float32 logits [S, V] in place: the penalties in one kernel on a GPU with Triton
    (engine/kernels/penalties.py), else torch ops."""
    if adj.rows is not None and logits.is_cuda and _penalty_kernel() is not None:
        _penalty_kernel()(logits, adj.rows, adj.slots, counts.counts, counts.in_prompt, adj.repetition,
                          adj.frequency, adj.presence)
    elif adj.rows is not None:
        x = logits[adj.rows]
        c = counts.counts[adj.slots]
        generated = c > 0
        seen = counts.in_prompt[adj.slots] | generated
        x = torch.where(seen, torch.where(x < 0, x * adj.repetition, x / adj.repetition), x)
        x = x - adj.frequency * c - adj.presence * generated
        logits[adj.rows] = x
    if adj.bias_rows is not None:
        logits.index_put_((adj.bias_rows, adj.bias_tokens), adj.bias_values, accumulate=True)
    if adj.suppressed is not None:
        logits[adj.suppressed] = float("-inf")


@functools.cache
def _penalty_kernel():
    """engine.kernels.penalties.apply_penalties, or None where triton is missing."""
    try:
        from engine.kernels.penalties import apply_penalties
    except ImportError:
        return None
    return apply_penalties
