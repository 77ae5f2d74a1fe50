"""One request's state: its sequences' tokens, where their KV lives, and how far each has been computed.

A request is a SequenceGroup. It starts as one sequence (the prompt); with n > 1 (or best_of) that
sequence forks into the others when its prompt's last chunk is scheduled, and beam search forks and drops
beams every step. Forked sequences share their parent's KV blocks (engine/core/block_manager.py).
"""
from __future__ import annotations

import time
from enum import Enum, auto
from itertools import count

from engine.core.prompt_logprobs import PromptLogprobs
from engine.sampling.params import SamplingParams

_seq_ids = count()


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class Sequence:
    def __init__(self, token_ids: list[int], params: SamplingParams, block_size: int,
                 request_id: str | None = None, group: "SequenceGroup | None" = None, index: int = 0):
        self.seq_id = next(_seq_ids)
        self.request_id = request_id if request_id is not None else str(self.seq_id)
        self.group = group
        self.index = index             # its completion's index in the group
        self.status = SequenceStatus.WAITING
        self.params = params
        self.block_size = block_size
        self.token_ids = list(token_ids)
        self.prompt_token_ids = list(token_ids)      # never changes
        self.completion_token_ids: list[int] = []    # grows with token_ids
        self.num_prompt_tokens = len(self.token_ids)
        self.num_computed_tokens = 0   # tokens whose K/V are in the cache
        self.num_cached_tokens = 0     # prompt tokens served by the prefix cache at the last admission
        self.num_hashed_blocks = 0     # leading full blocks registered in the prefix cache
        self.hashed_prefix = -1        # the chain hash of those blocks (where the next one's chains from)
        self.prefix_hashes: tuple[int, list[int]] | None = None  # (num_tokens, its blocks' hashes): scheduler's
        self.num_released_blocks = 0   # leading blocks handed back, outside every layer's sliding window
        self.block_table: list[int] = []
        self.long_rope = False         # LongRoPE: its keys rotate with the long factors (set with its blocks)
        self.finish_reason: str | None = None
        self.error: str | None = None  # set when the request failed on its own data
        self.detokenizer = None        # engine.detokenizer.Detokenizer of a request that needs its text as it comes
        self.logprobs: list[dict] = []
        self.cumulative_logprob = 0.0  # the sum of its completion tokens' logprobs
        self.beam_score = 0.0          # beam search: the running beam's summed logprob, as float32
        self.num_reported_tokens = 0   # completion tokens already handed out by step()
        self.max_num_tokens = len(self.token_ids) + (params.max_tokens or 0)  # capped by the engine
        self.pending_index = -1        # row of its last token in the launch still sampling it (-1 in token_ids)
        self.grammar = None            # engine.grammar.GrammarState of a constrained (structured output) request
        self.multimodal = None         # engine.multimodal.MultimodalInputs of a prompt with images (seed 003)
        self.mrope_position_delta = 0  # M-RoPE: a token past the prompt rotates at its index + this (seed 001)
        self.pooling = None            # engine.core.pooling.PooledState of an embedding request (never sampled)
        self.lora = None               # engine.lora.LoRARequest of a request under an adapter (None: the base model)
        self.lora_slot = -1            # its adapter's device slot while it runs (engine/lora/slots.py)
        self.arrival_time = time.monotonic()
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.finished_time: float | None = None

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    @property
    def num_completion_tokens(self) -> int:
        return len(self.completion_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def num_blocks(self) -> int:
        return (len(self.token_ids) + self.block_size - 1) // self.block_size

    def block(self, i: int) -> list[int]:
        return self.token_ids[i * self.block_size: (i + 1) * self.block_size]

    def block_image_key(self, i: int) -> tuple[int, ...] | None:
        """The content hashes of the images whose tokens block i holds (None without): the prefix cache keys
        such a block by them too, so the same tokens with another image never hit."""
        mm = self.multimodal
        if mm is None:
            return None
        return mm.image_key(i * self.block_size, (i + 1) * self.block_size)

    @property
    def num_resolved_completion_tokens(self) -> int:
        """Completion tokens whose values are known (a launch in flight leaves a -1 at the end)."""
        ids = self.completion_token_ids
        return len(ids) - 1 if ids and ids[-1] < 0 else len(ids)

    @property
    def reuses_cached_prefix(self) -> bool:
        """Whether its admission may take prompt blocks from the prefix cache (mean and CLS pooling need
        every position's hidden state, which a hit does not compute)."""
        return (self.pooling is None or self.pooling.reuses_cached_prefix) and not self.scores_prompt

    @property
    def scores_prompt(self) -> bool:
        """Whether its steps score its prompt's tokens (prompt_logprobs, until every one is scored): the
        logits of every prompt position are needed, so a prefix-cache hit would skip some."""
        scores = self.group.prompt_logprobs if self.group is not None else None
        return scores is not None and not scores.done

    @property
    def admission_width(self) -> int:
        """Sequence slots its admission takes: a group's first sequence will fork into all of them."""
        group = self.group
        return group.width if group is not None and self is group.seqs[0] and not group.forked else 1

    def truncate(self, num_tokens: int) -> None:
        del self.token_ids[num_tokens:]
        del self.completion_token_ids[max(0, num_tokens - self.num_prompt_tokens):]

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        self.completion_token_ids.append(token_id)

    def fork(self, index: int) -> "Sequence":
        """A new sequence of the same group with this one's tokens and computed state; the caller shares its
        KV blocks (BlockManager.fork) and places it in the scheduler."""
        child = Sequence.__new__(Sequence)
        child.__dict__.update(self.__dict__)
        child.seq_id = next(_seq_ids)
        child.index = index
        child.token_ids = list(self.token_ids)
        child.completion_token_ids = list(self.completion_token_ids)
        child.block_table = []
        child.logprobs = list(self.logprobs)
        child.num_reported_tokens = 0
        child.pending_index = -1
        child.grammar = self.grammar.fork() if self.grammar is not None else None  # a matcher of its own
        child.detokenizer = self.detokenizer.fork() if self.detokenizer is not None else None
        return child


class SequenceGroup:
    """One request: its prompt, its parameters and its sequences (n, best_of or beam_width of them)."""

    def __init__(self, request_id: str, token_ids: list[int], params: SamplingParams, block_size: int,
                 beam=None):
        self.request_id = request_id
        self.params = params
        self.beam = beam  # engine.beam_search.BeamSearch for a beam search request, else None
        self.width = beam.width if beam is not None else params.num_sequences
        self.forked = self.width == 1  # the first sequence forks into the others once (for beams: the first step)
        # sampling: every sequence, by index; beam search: the running beams
        self.seqs = [Sequence(token_ids, params, block_size, request_id, self)]
        self.prompt_logprobs = (None if params.prompt_logprobs is None
                                else PromptLogprobs(self.seqs[0].prompt_token_ids, params.prompt_logprobs))
        self.error: str | None = None
        self.finished_time: float | None = None
        self.streams = False  # added with stream=True: every step's tokens are reported, not just the end

    @property
    def first(self) -> Sequence:
        return self.seqs[0]

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.seqs[0].prompt_token_ids

    @property
    def is_finished(self) -> bool:
        if self.beam is not None:
            return self.beam.done
        return all(s.is_finished for s in self.seqs)

    def live_seqs(self) -> list[Sequence]:
        return [s for s in self.seqs if not s.is_finished]
