"""Decides what runs in each step; computes nothing.

Each step gets a token budget (max_num_batched_tokens) and a sequence cap (max_num_seqs). Running
sequences go first: decodes (one token each), then prompts part-way through a chunked prefill; the
budget left admits waiting sequences, whose prompts are cut into chunks when they do not fit. When a
decode needs a KV block and none is free, the newest running sequence is preempted: its blocks are
freed and it waits to be recomputed (its computed blocks usually come back from the prefix cache).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from engine.block_manager import BlockManager
from engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    seqs: list[Sequence]
    num_tokens: list[int]         # tokens computed for each sequence in this step

    @property
    def total_tokens(self) -> int:
        return sum(self.num_tokens)

    def __bool__(self) -> bool:
        return bool(self.seqs)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []     # in admission order: the last one is the newest
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        budget = self.max_num_batched_tokens
        batch = ScheduledBatch([], [])
        # a sequence whose last sampled token is its final one (its value may still be in flight) needs no step
        active = [s for s in self.running if s.num_tokens < s.max_num_tokens]
        decodes = [s for s in active if s.num_uncomputed_tokens == 1]
        prefills = [s for s in active if s.num_uncomputed_tokens > 1]
        for seq in decodes:
            if budget == 0:
                break
            if seq.status != SequenceStatus.RUNNING:  # preempted while making room for an earlier one
                continue
            if not self._make_room_for(seq):
                continue
            self.block_manager.append_slot(seq)
            batch.seqs.append(seq)
            batch.num_tokens.append(1)
            budget -= 1
        for seq in prefills:
            if budget == 0:
                break
            if seq.status != SequenceStatus.RUNNING:
                continue
            n = min(seq.num_uncomputed_tokens, budget)
            batch.seqs.append(seq)
            batch.num_tokens.append(n)
            budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if not self.block_manager.can_allocate(seq):
                break
            self.waiting.popleft()
            self.block_manager.allocate(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            n = min(seq.num_uncomputed_tokens, budget)
            batch.seqs.append(seq)
            batch.num_tokens.append(n)
            budget -= n
        return batch

    def _make_room_for(self, seq: Sequence) -> bool:
        """Preempt the newest running sequences until `seq` can take its next token's slot."""
        while not self.block_manager.can_append(seq):
            victim = self.running[-1]
            self.preempt(victim)
            if victim is seq:
                return False
        return True

    def preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens = 0
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def finish(self, seq: Sequence, reason: str) -> None:
        """Mark `seq` finished and release its blocks."""
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
            self.block_manager.free(seq)
        elif seq.status == SequenceStatus.WAITING:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    def num_free_slots(self) -> int:
        return max(0, self.max_num_seqs - len(self.running) - len(self.waiting))
