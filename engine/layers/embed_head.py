"""Vocabulary-parallel embedding and LM head: each rank holds a contiguous slice of the vocabulary.

Gemma's embedding scales its rows by sqrt(hidden_size) (in the model's dtype), and Gemma 2's LM head soft-caps
its logits (cap x tanh(logit / cap)): both where the rows and the logits are made, so every path to the sampler
(the decode graphs', the sharded sampling's) sees the same values."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.fusion import embedding, linear, soft_cap
from engine.layers.parallel import SINGLE, TPGroup


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, tp: TPGroup = SINGLE, scale: float | None = None):
        """scale: every row scaled by it, rounded to the model's dtype first (a buffer, cast with the model)."""
        super().__init__()
        self.tp = tp
        self.register_buffer("scale", None if scale is None else torch.tensor(scale), persistent=False)
        self.vocab_size = vocab_size
        self.local_vocab = (vocab_size + tp.size - 1) // tp.size
        self.vocab_start = tp.rank * self.local_vocab
        self.weight = nn.Parameter(torch.zeros(self.local_vocab, hidden_size), requires_grad=False)
        self.weight.full_shape = (vocab_size, hidden_size)
        self.weight.weight_loader = self.weight_loader
        self.weight.load_full = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        part = loaded[self.vocab_start: self.vocab_start + self.local_vocab]
        param.data[: part.shape[0]].copy_(part)  # the last rank's slice may be padded

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return embedding(input_ids, self.weight, self.scale)
        local = input_ids - self.vocab_start
        mine = (local >= 0) & (local < self.local_vocab)
        out = F.embedding(local.clamp(0, self.local_vocab - 1), self.weight) * mine.unsqueeze(-1)
        out = self.tp.all_reduce(out)  # one rank's row and zeros: the sum is that row exactly
        return out if self.scale is None else out * self.scale


class ParallelLMHead(VocabParallelEmbedding):
    def __init__(self, vocab_size: int, hidden_size: int, tp: TPGroup = SINGLE, softcap: float | None = None):
        """softcap: the logits soft-capped to softcap x tanh(logit / softcap) (Gemma 2), None for none."""
        super().__init__(vocab_size, hidden_size, tp)
        self.softcap = softcap

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, hidden] of the positions to sample → logits [N, vocab_size]. A few rows (decode)
        go through the engine's GEMV (engine/layers/fusion.py linear), more through cuBLAS."""
        logits = linear(hidden, self.weight)
        return self._capped(self.tp.gather_last_dim(logits)[:, : self.vocab_size])

    def local_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, hidden] → this rank's logits [N, n], of tokens vocab_start .. vocab_start + n - 1
        (the last rank's padding past vocab_size left out); each the same as forward's."""
        num_tokens = max(0, min(self.local_vocab, self.vocab_size - self.vocab_start))
        return self._capped(linear(hidden, self.weight)[:, :num_tokens])

    def _capped(self, logits: torch.Tensor) -> torch.Tensor:
        return logits if self.softcap is None else soft_cap(logits, self.softcap)
