"""Beam search for one prompt: which beams go on after each step and which hypotheses are returned.

It decides as transformers' generate(num_beams=W, num_return_sequences=W, length_penalty=L,
early_stopping=True, do_sample=False) does. Each step ranks the K = max(2, 1 + number of EOS ids) * W
best extensions of all beams by summed logprob (float32, as transformers sums). A candidate that ends a
hypothesis (an EOS, or the last allowed token) finishes it only if it ranks in the top W; it then scores
sum_logprobs / generated_length ** L (its last token counted) and joins the at most W finished ones,
best first. The best W candidates that do not end become the next beams. The search stops once W
hypotheses are finished, or when every candidate ends (max_tokens).

The engine (engine/core/llm_engine.py) runs each beam as a Sequence sharing its parent's KV blocks: it
reports each beam's top K logprobs once all beams of the step have them, and forks, extends and drops
sequences as `select` says.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.sampling.params import BeamSearchParams


@dataclass
class Hypothesis:
    """A finished beam."""
    score: np.float32             # sum_logprobs / generated_length ** length_penalty
    cumulative_logprob: np.float32
    token_ids: list[int]          # its completion, the last token included
    finish_reason: str            # "stop" (an EOS) or "length"


@dataclass
class Extension:
    """A beam that goes on: `parent` extended by `token_id`, its summed logprob now `score`."""
    parent: object                # engine.sequence.Sequence
    token_id: int
    score: np.float32


class BeamSearch:
    def __init__(self, params: BeamSearchParams, eos_token_ids: list[int]):
        self.width = params.beam_width
        self.length_penalty = params.length_penalty
        self.eos = frozenset() if params.ignore_eos else frozenset(eos_token_ids)
        self.num_candidates = max(2, 1 + len(self.eos)) * self.width
        self.max_tokens = params.max_tokens  # the engine caps it to the context
        self.beams: list = []     # the running beams' sequences, best first
        self.reports: dict[int, tuple[list[float], list[int]]] = {}  # seq_id -> top logprobs, their ids
        self.finished: list[Hypothesis] = []
        self.done = False

    def report(self, seq, logprobs: list[float], token_ids: list[int]) -> None:
        """Beam `seq`'s top logprobs for its next token (at least num_candidates of them)."""
        self.reports[seq.seq_id] = (logprobs, token_ids)

    @property
    def ready(self) -> bool:
        """Every running beam has reported this step."""
        return all(b.seq_id in self.reports for b in self.beams)

    def select(self) -> list[Extension]:
        """One step: the finished hypotheses updated, and the beams that go on, best first (none once done)."""
        candidates = []
        for b, beam in enumerate(self.beams):
            logprobs, token_ids = self.reports[beam.seq_id]
            base = np.float32(beam.beam_score)
            candidates += [(base + np.float32(lp), b, t) for lp, t in zip(logprobs, token_ids)]
        self.reports.clear()
        candidates.sort(key=lambda c: (-c[0], c[1], c[2]))  # ties: the lower beam, then the lower token id
        candidates = candidates[: self.num_candidates]
        length = self.beams[0].num_completion_tokens + 1  # every beam has as many tokens
        at_limit = length >= self.max_tokens
        penalty = np.float32(length ** self.length_penalty)
        ends = [at_limit or t in self.eos for _, _, t in candidates]
        new = [Hypothesis(score / penalty, score, self.beams[b].completion_token_ids + [t],
                          "stop" if t in self.eos else "length")
               for (score, b, t), end in zip(candidates[: self.width], ends) if end]
        if new:  # a stable sort: of equal scores the earlier hypothesis stays first
            self.finished = sorted(self.finished + new, key=lambda h: -h.score)[: self.width]
        going_on = [Extension(self.beams[b], t, score) for (score, b, t), end in zip(candidates, ends) if not end]
        self.done = len(self.finished) >= self.width or all(ends)
        return [] if self.done else going_on[: self.width]
