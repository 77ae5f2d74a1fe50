"""Decides what runs in each step; computes nothing.

Each step gets a token budget (max_num_batched_tokens) and a sequence cap (max_num_seqs). Running
sequences go first: decodes (one token each), then prompts part-way through a chunked prefill; the
budget left admits waiting sequences (one under a LoRA adapter only when its adapter has or can take a
device slot: engine/lora/slots.py), whose prompts are cut into chunks when they do not fit. When a
decode needs a KV block and none is free, the newest running sequence is preempted: its blocks are
freed and it waits to be recomputed (its computed blocks usually come back from the prefix cache). A
preemption shows that admission promised more than the cache holds, so from then on a waiting sequence is
admitted only while the blocks the running ones (and it) are expected still to take stay free, times
`growth_ratio`, which decays every step without a preemption; a sequence is expected to run to the share of
its max_tokens that finished sequences used (to all of it with ignore_eos). With LongRoPE, a running
sequence that grows past the switch to the long factors is recomputed the same way, from its first token
(BlockManager.rotates_anew), without counting as a preemption. Where every layer slides, a running
sequence's blocks that its windows have passed are handed back before each step.

A request of n > 1 sequences (at most max_seqs_per_request, which the engine checks when it is added, so
that no request holds every slot) is admitted when there are slots for all of them; when its prompt's last
chunk is scheduled the prompt's sequence forks into the others, which share its blocks and are sampled
from the same logits (`ScheduledBatch.forks`).

With `prefer_cached`, the waiting sequence admitted next is the one (of the first WAITING_SCAN) whose prompt
has the most leading blocks in the prefix cache, the first of equals; one whose next uncached block another
sequence is computing now waits a step and then finds it cached, rather than computing it a second time.
A request of several sequences, beam search, images or LongRoPE's long factors is never passed over.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from itertools import islice

from engine.core.block_manager import BlockManager, chain_root, prefix_block_hashes
from engine.core.sequence import Sequence, SequenceStatus
from engine.lora.slots import LoRASlots

# After a preemption, admission keeps free the blocks running sequences are expected still to take: to reach
# the share of their max_tokens that finished sequences used (a moving average over about USED_SHARE_SPAN of
# them, from USED_SHARE_PRIOR; all of it with ignore_eos), times `growth_ratio`: 1 at a preemption, multiplied
# by GROWTH_DECAY every step without one, to nothing below GROWTH_MIN (before the first preemption admission
# reserves nothing).
USED_SHARE_PRIOR = 0.5
USED_SHARE_SPAN = 32
GROWTH_DECAY = 0.99
GROWTH_MIN = 0.01

# with prefer_cached, waiting sequences looked at for the best cached prefix each admission: the queue's
# head and what came soon after it (the worker keeps the engine's waiting list short; LLM.generate may not)
WAITING_SCAN = 64


@dataclass
class ScheduledBatch:
    seqs: list[Sequence]
    num_tokens: list[int]         # tokens computed for each sequence in this step
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # (source, destination), before the step
    forks: dict[int, list[Sequence]] = field(default_factory=dict)     # seq_id -> sequences sampled from its row
    lora_loads: list[tuple[int, int, str, str]] = field(default_factory=list)  # (slot, int_id, name, path), first

    def sampled(self) -> list[Sequence]:
        """The sequences that get a token from this step, in the order of the step's logits rows: each whose
        scheduled tokens reach its end, followed by those forked from it (an embedding request gets none)."""
        if not self.forks:
            return [s for s, n in zip(self.seqs, self.num_tokens)
                    if s.num_computed_tokens + n == s.num_tokens and s.pooling is None]
        out = []
        for seq, n in zip(self.seqs, self.num_tokens):
            if seq.num_computed_tokens + n == seq.num_tokens and seq.pooling is None:
                out.append(seq)
                out += self.forks.get(seq.seq_id, ())
        return out

    @property
    def total_tokens(self) -> int:
        return sum(self.num_tokens)

    def __bool__(self) -> bool:
        return bool(self.seqs)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 prefer_cached: bool = False, lora_slots: LoRASlots | None = None):
        self.block_manager = block_manager
        self.prefer_cached = prefer_cached  # admit waiting sequences whose prefix is cached first
        self.lora_slots = lora_slots  # the device's adapter slots (an engine serving LoRA adapters)
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []     # in admission order: the last one is the newest
        self.num_preemptions = 0
        self.growth_ratio = 0.0  # share of running sequences' remaining blocks admission keeps free
        self.used_share = USED_SHARE_PRIOR  # of their max_tokens, the share finished sequences used

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        budget = self.max_num_batched_tokens
        batch = ScheduledBatch([], [])
        # a sequence whose last sampled token is its final one (its value may still be in flight) needs no step
        active = [s for s in self.running if s.num_tokens < s.max_num_tokens]
        bm = self.block_manager
        if bm.long_rope_after is not None or bm.sliding_window:  # blocks to hand back, or keys to rotate anew
            for seq in active:
                if bm.rotates_anew(seq):
                    self._release(seq)
                else:
                    bm.release_out_of_window(seq)
            active = [s for s in active if s.status == SequenceStatus.RUNNING]
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
            budget -= self._add(batch, seq, min(seq.num_uncomputed_tokens, budget))
        computing = self._blocks_computing() if self.prefer_cached and self.waiting else None
        reserve = 0.0  # blocks kept free for the running sequences' growth
        if self.growth_ratio:
            self.growth_ratio = self.growth_ratio * GROWTH_DECAY if self.growth_ratio > GROWTH_MIN else 0.0
            if self.waiting and active:  # with nothing running, nothing grows: admission never stalls
                reserve = self.growth_ratio * sum(self._blocks_to_come(s) for s in active)
        while self.waiting and budget > 0:
            seq = self.waiting[0] if computing is None else self._next_waiting(computing)
            if seq is None:
                break
            own = self.growth_ratio * self._blocks_to_come(seq) if reserve else 0.0
            if (len(self.running) + seq.admission_width > self.max_num_seqs
                    or not self.block_manager.can_allocate(seq, int(reserve + own))):
                break
            reserve += own
            if seq.lora is not None and not self._take_lora_slot(seq):
                break
            if seq is self.waiting[0]:
                self.waiting.popleft()
            else:
                self.waiting.remove(seq)
            self.block_manager.allocate(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            budget -= self._add(batch, seq, min(seq.num_uncomputed_tokens, budget))
            if computing is not None and self._passable(seq):
                computing.update(self._prefix_hashes(seq)[seq.num_hashed_blocks:])
        batch.block_copies = self.block_manager.take_copies()
        if self.lora_slots is not None:
            batch.lora_loads = self.lora_slots.take_loads()
        return batch

    def _passable(self, seq: Sequence) -> bool:
        """Whether prefer_cached may admit others before `seq` (a plain request: one sequence, no beams, no
        images, short-factor rotation), and so whether its blocks' hashes are those prefix_block_hashes makes."""
        group = seq.group
        return ((group is None or (group.width == 1 and group.beam is None)) and seq.multimodal is None
                and not self.block_manager.takes_long_rope(seq))

    def _prefix_hashes(self, seq: Sequence) -> list[int]:
        """The prefix-cache hashes of a passable `seq`'s leading blocks, kept on it while its length stays."""
        memo = seq.prefix_hashes
        if memo is None or memo[0] != seq.num_tokens:
            hashes = prefix_block_hashes(seq.token_ids, seq.block_size, chain_root(seq, False))
            memo = seq.prefix_hashes = (seq.num_tokens, hashes)
        return memo[1]

    def _blocks_computing(self) -> set[int]:
        """Hashes of the prompt blocks running sequences compute (not yet in the prefix cache)."""
        computing: set[int] = set()
        for seq in self.running:  # hashed when it waited; blocks entered once their step is collected
            if seq.prefix_hashes is not None and seq.num_hashed_blocks < len(seq.prefix_hashes[1]):
                computing.update(seq.prefix_hashes[1][seq.num_hashed_blocks:])
        return computing

    def _next_waiting(self, computing: set[int]) -> Sequence | None:
        """The waiting sequence to admit next with prefer_cached (None: each waits for a prefix computing now)."""
        best, best_hits = None, -1
        for seq in islice(self.waiting, WAITING_SCAN):
            if not self._passable(seq):
                return best or seq  # nothing after it goes first
            hashes = self._prefix_hashes(seq)
            hits = self.block_manager.num_cached_blocks(hashes)
            if hits < len(hashes) and hashes[hits] in computing:
                continue
            if hits > best_hits:
                best, best_hits = seq, hits
        return best

    def _take_lora_slot(self, seq: Sequence) -> bool:
        """Give `seq` its adapter's slot; False while every slot holds another adapter that running sequences use."""
        busy = {s.lora_slot for s in self.running if s.lora is not None}
        slot = self.lora_slots.acquire(seq.lora, busy)
        if slot is None:
            return False
        seq.lora_slot = slot
        return True

    def _add(self, batch: ScheduledBatch, seq: Sequence, n: int) -> int:
        """Schedule n prompt tokens of `seq`; at its prompt's end a group's first sequence forks."""
        batch.seqs.append(seq)
        batch.num_tokens.append(n)
        group = seq.group
        at_end = seq.num_computed_tokens + n == seq.num_tokens
        if group is not None and not group.forked and group.beam is None and at_end:
            children = batch.forks[seq.seq_id] = self.fork(seq, range(1, group.width), seq.num_computed_tokens + n)
            group.seqs += children
            group.forked = True
        return n

    def fork(self, parent: Sequence, indices, num_computed: int) -> list[Sequence]:
        """Sequences of `parent`'s group, one per index, that share its blocks (computed up to num_computed)
        and its state in the scheduler: running after the running ones, or waiting right behind it."""
        children = []
        for index in indices:
            child = parent.fork(index)
            child.num_computed_tokens = num_computed if parent.status == SequenceStatus.RUNNING else 0
            self.block_manager.fork(parent, child)
            children.append(child)
        if parent.status == SequenceStatus.RUNNING:
            self.running.extend(children)
        else:
            at = self.waiting.index(parent) + 1
            for child in reversed(children):
                self.waiting.insert(at, child)
        return children

    def _make_room_for(self, seq: Sequence) -> bool:
        """Preempt the newest running sequences until `seq` can take its next token's slot."""
        while not self.block_manager.can_append(seq):
            victim = self.running[-1]
            self.preempt(victim)
            if victim is seq:
                return False
        return True

    def preempt(self, seq: Sequence, to_back: bool = False) -> None:
        self._release(seq, to_back)
        self.num_preemptions += 1
        self.growth_ratio = 1.0

    def _blocks_to_come(self, seq: Sequence) -> int:
        """Blocks `seq` is expected to take beyond those of its tokens so far: to the share of its max_tokens
        that finished sequences used (all of it once past that share, or with ignore_eos)."""
        max_tokens = seq.max_num_tokens - seq.num_prompt_tokens
        share = 1.0 if seq.params.ignore_eos else self.used_share
        expected = min(max(seq.num_completion_tokens, round(share * max_tokens)), max_tokens)
        held = max(len(seq.block_table), seq.num_blocks)
        return max(0, -(-(seq.num_prompt_tokens + expected) // self.block_manager.block_size) - held)

    def _release(self, seq: Sequence, to_back: bool = False) -> None:
        """Free a running `seq`'s blocks; it waits (first, or with to_back last) to be computed from its start."""
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens = 0
        if to_back:
            self.waiting.append(seq)
        else:
            self.waiting.appendleft(seq)

    def make_room_for_waiting(self) -> None:
        """Nothing can run (the running sequences are beams whose step waits for a sibling that is waiting for
        blocks): preempt the newest running sequence, of another request if one is there, to the back of the
        queue, so that the first waiting one gets its blocks. A beam keeps the candidates it has reported."""
        head = self.waiting[0]
        others = [s for s in self.running if s.group is not head.group]
        self.preempt((others or self.running)[-1], to_back=True)

    def finish(self, seq: Sequence, reason: str | None) -> None:
        """Mark `seq` finished and release its blocks."""
        max_tokens = seq.max_num_tokens - seq.num_prompt_tokens
        if reason in ("stop", "length") and seq.pooling is None and max_tokens > 0:  # ended by its own tokens
            used = min(seq.num_completion_tokens / max_tokens, 1.0)
            self.used_share += (used - self.used_share) / USED_SHARE_SPAN
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
            self.block_manager.free(seq)
        elif seq.status == SequenceStatus.WAITING:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    def num_free_slots(self) -> int:
        return max(0, self.max_num_seqs - len(self.running) - sum(s.admission_width for s in self.waiting))
