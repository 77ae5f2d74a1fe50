"""Prompt log-probabilities (SamplingParams.prompt_logprobs): which rows of a step score prompt tokens, and
a request's scores gathered from the steps that computed them into vLLM's shape.

The logits at prompt position p score prompt token p + 1, so a prompt of P tokens has P - 1 scored tokens
and its first token none. A step computing positions start .. end - 1 of a sequence that scores its prompt
scores the tokens start + 1 .. min(end, P - 1): each chunk of a chunked prefill brings its part. Such a
sequence reads no block from the prefix cache (engine/core/block_manager.py) until every token is scored,
so no position is skipped by a hit; a preempted one recomputes its prompt, and a position scored twice
keeps one score.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from engine.core.outputs import Logprob

if TYPE_CHECKING:
    from engine.core.scheduler import ScheduledBatch
    from engine.core.sequence import Sequence


class PromptLogprobs:
    """One request's prompt scores: each scored token's (logprob, rank, top ids, top logprobs), filled in
    as steps bring them; once all are in, the output's list, built once."""

    def __init__(self, prompt_token_ids: list[int], num_top: int):
        self.token_ids = prompt_token_ids
        self.num_top = num_top
        self.scores: list[tuple | None] = [None] * len(prompt_token_ids)  # by the position of the token scored
        self.num_missing = len(prompt_token_ids) - 1
        self._output: tuple[list, list] | None = None

    @property
    def done(self) -> bool:
        return self.num_missing == 0

    def add(self, first: int, logprobs: list[float], ranks: list[int], top_values: list | None,
            top_ids: list | None) -> None:
        """The scores of tokens first + 1, first + 2, ... (their rows of one step, in order)."""
        for i, (logprob, rank) in enumerate(zip(logprobs, ranks)):
            position = first + 1 + i
            if self.scores[position] is None:
                self.num_missing -= 1
            top = (top_ids[i][:self.num_top], top_values[i][:self.num_top]) if top_ids is not None else ((), ())
            self.scores[position] = (logprob, rank, *top)

    def output(self, tokenizer) -> tuple[list[dict[int, Logprob] | None], list[str] | None]:
        """(The prompt logprobs as vLLM returns them: None for the first token, then for each token a dict
        {token id: Logprob} of the token itself, then the top num_top, best first; each prompt token's
        text, the first one's included, or None without a tokenizer). Built once, when done."""
        if self._output is None:
            ids = set(self.token_ids)
            for score in self.scores[1:]:
                ids.update(score[2])
            texts = _texts(sorted(ids), tokenizer)
            entries: list[dict[int, Logprob] | None] = [None]
            for token_id, (logprob, rank, top_ids, top_values) in zip(self.token_ids[1:], self.scores[1:]):
                entry = {token_id: Logprob(logprob, rank, texts.get(token_id))}
                for i, (t, lp) in enumerate(zip(top_ids, top_values)):
                    entry.setdefault(t, Logprob(lp, i + 1, texts.get(t)))
                entries.append(entry)
            self._output = entries, ([texts[t] for t in self.token_ids] if texts else None)
        return self._output


def _texts(ids: list[int], tokenizer) -> dict[int, str]:
    """Each token's text, in one call for all of them ({} without a tokenizer)."""
    if tokenizer is None:
        return {}
    return dict(zip(ids, tokenizer.batch_decode([[t] for t in ids])))


def prompt_spans(batch: "ScheduledBatch") -> list[tuple[int, "Sequence", int, int]]:
    """The step's rows that score prompt tokens, before the step advances its sequences: (index of the
    sequence in the batch, the sequence, its chunk's first position, how many of the chunk's first rows
    score)."""
    spans = []
    for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_tokens)):
        if seq.scores_prompt:
            start = seq.num_computed_tokens
            count = min(start + n, seq.num_prompt_tokens - 1) - start
            if count > 0:
                spans.append((i, seq, start, count))
    return spans
