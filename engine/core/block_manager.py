"""Paged KV blocks: allocation, reference counts and the prefix cache.

A full block is identified by the xxhash of its tokens chained to the previous block's hash, so a hit
means the whole prefix matches; a block that holds image tokens hashes its images' content hashes too (the
same placeholder tokens with another image never hit). Tokens are stored too and compared on a hit, so a hash collision can
never serve wrong K/V. A block is registered only once its K/V have been computed. Freed blocks keep
their hash and go to the back of the free list; allocation takes from the front, so blocks that hold
nothing are reused first, then cached ones least-recently-used first.

A forked sequence (n > 1, beam search) shares its parent's blocks by reference count. A shared block is
never written: a sequence about to write its next token into one gets a copy of it first (copy on write),
and the copies wait in `pending_copies` until the step's forward pass makes them on the device.

With LongRoPE (Phi-3's long-context checkpoints) a sequence longer than `long_rope_after` tokens when it is
given its blocks rotates all its keys with the long factors (`Sequence.long_rope`): its blocks' hashes chain
from a root of their own, so they never serve a sequence that rotates with the short factors, nor the reverse.

Where every layer attends through a sliding window, a running sequence's leading blocks that no later query can
see (wholly before its next token's window) are handed back as it goes (release_out_of_window), once they are
in the prefix cache: its table keeps a block it holds in their place, which the kernels may read (a tile can
start before the window) but never weigh. A prefix hit must chain from the first block, so a prompt finds
those blocks only while they are still cached.
"""
from __future__ import annotations

from collections import OrderedDict

import numpy as np
import xxhash

from engine.core.sequence import Sequence


LORA_ROOT = 0x4C6F5241  # marks the chain root of an adapter's blocks
LONG_ROPE_ROOT = 0x4C6F6E67526F5045  # the hash a chain of long-factor blocks starts from (others: none, -1)


def chain_root(seq: Sequence, long_rope: bool) -> int:
    """The hash a sequence's block chain starts from: its rotary factors' and its LoRA adapter's (a block
    computed under one adapter never serves another, nor the base model)."""
    root = LONG_ROPE_ROOT if long_rope else -1
    return root if seq.lora is None else adapter_root(seq.lora.int_id, root)


def adapter_root(int_id: int, root: int = -1) -> int:
    """The chain root of blocks computed under the LoRA adapter `int_id` (from `root`: the rotary factors')."""
    return chain_hash([int_id], root, (LORA_ROOT,))


def chain_hash(token_ids: list[int], prefix_hash: int, image_key: tuple[int, ...] | None = None) -> int:
    h = xxhash.xxh64()
    if prefix_hash != -1:
        h.update(prefix_hash.to_bytes(8, "little"))
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    if image_key is not None:  # the block holds image tokens: their images' content hashes
        h.update(np.asarray(image_key, dtype=np.uint64).tobytes())
    return h.intdigest()


def prefix_block_hashes(token_ids: list[int], block_size: int, root: int = -1) -> list[int]:
    """The prefix-cache hashes of a text prompt's leading full blocks, as the block manager enters and looks
    them up (a prompt without images, rotated with the short factors; `root`: chain_root's, for an adapter's).
    The last token is always computed, so the block that holds it is never looked up and has no hash here."""
    hashes: list[int] = []
    prefix_hash = root
    for start in range(0, (len(token_ids) - 1) // block_size * block_size, block_size):
        prefix_hash = chain_hash(token_ids[start:start + block_size], prefix_hash)
        hashes.append(prefix_hash)
    return hashes


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "token_ids", "image_key")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash = -1
        self.token_ids: list[int] = []
        self.image_key: tuple[int, ...] | None = None


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 long_rope_after: int | None = None, sliding_window: int = 0):
        self.block_size = block_size
        self.sliding_window = sliding_window  # every layer's window is at most this; 0: some layer sees it all
        self.long_rope_after = long_rope_after  # LongRoPE: sequences longer than this take the long factors
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.hash_to_block_id: dict[int, int] = {}
        self.free_block_ids: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.num_cache_queries = 0  # tokens looked up in the prefix cache
        self.num_cache_hits = 0     # tokens found there
        self.pending_copies: list[tuple[int, int]] = []  # (source, destination) block copies for the next step

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def _take_free_block(self) -> int:
        block_id, _ = self.free_block_ids.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash != -1 and self.hash_to_block_id.get(block.hash) == block_id:
            del self.hash_to_block_id[block.hash]
        block.hash = -1
        block.token_ids = []
        block.image_key = None
        block.ref_count = 1
        return block_id

    def takes_long_rope(self, seq: Sequence) -> bool:
        """Whether `seq`, given blocks now, rotates with LongRoPE's long factors."""
        return self.long_rope_after is not None and seq.num_tokens > self.long_rope_after

    def rotates_anew(self, seq: Sequence) -> bool:
        """Whether a running `seq` has grown past long_rope_after while its keys rotate with the short factors:
        it must be computed anew (transformers recomputes its cache there)."""
        return not seq.long_rope and self.takes_long_rope(seq)

    def _cached_prefix(self, seq: Sequence) -> list[int]:
        """Block ids of the longest computed prefix of `seq` already in the cache."""
        hits: list[int] = []
        if not self.enable_prefix_caching or not seq.reuses_cached_prefix:
            return hits
        prefix_hash = chain_root(seq, self.takes_long_rope(seq))
        # the last token is always computed, so a prompt never hits in full
        for i in range((seq.num_tokens - 1) // self.block_size):
            tokens, image_key = seq.block(i), seq.block_image_key(i)
            prefix_hash = chain_hash(tokens, prefix_hash, image_key)
            block_id = self.hash_to_block_id.get(prefix_hash)
            if block_id is None:
                break
            block = self.blocks[block_id]
            if block.token_ids != tokens or block.image_key != image_key:
                break
            hits.append(block_id)
        return hits

    def num_cached_blocks(self, hashes: list[int]) -> int:
        """How many of these leading block hashes (prefix_block_hashes) the prefix cache holds now. A read
        of one dict, safe from another thread: a hint for ordering work, never a promise of a hit."""
        if not self.enable_prefix_caching:
            return 0
        n = 0
        for h in hashes:
            if h not in self.hash_to_block_id:
                break
            n += 1
        return n

    def can_allocate(self, seq: Sequence, reserve: int = 0) -> bool:
        """Whether `seq` gets its blocks with `reserve` blocks still free after."""
        hits = self._cached_prefix(seq)
        num_reused_free = sum(1 for b in hits if self.blocks[b].ref_count == 0)
        return seq.num_blocks - len(hits) + num_reused_free + reserve <= self.num_free_blocks

    def allocate(self, seq: Sequence) -> None:
        """Give `seq` blocks for all its tokens, reusing cached prefix blocks."""
        assert not seq.block_table
        seq.long_rope = self.takes_long_rope(seq)
        hits = self._cached_prefix(seq)
        for block_id in hits:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_block_ids[block_id]
            block.ref_count += 1
        seq.block_table = hits + [self._take_free_block() for _ in range(seq.num_blocks - len(hits))]
        seq.num_hashed_blocks = len(hits)
        seq.hashed_prefix = (self.blocks[hits[-1]].hash if hits
                             else chain_root(seq, seq.long_rope))
        seq.num_released_blocks = 0
        seq.num_cached_tokens = len(hits) * self.block_size
        seq.num_computed_tokens = seq.num_cached_tokens
        if self.enable_prefix_caching:
            self.num_cache_queries += seq.num_tokens
            self.num_cache_hits += seq.num_cached_tokens

    def free(self, seq: Sequence) -> None:
        """Release `seq`'s blocks; computed full blocks stay findable until reused."""
        for block_id in reversed(seq.block_table[seq.num_released_blocks:]):
            self._release(block_id)
        seq.block_table = []
        seq.num_hashed_blocks = 0
        seq.num_released_blocks = 0

    def _release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 0:
            self.free_block_ids[block_id] = None
            if block.hash == -1:  # holds nothing worth keeping: reuse it first
                self.free_block_ids.move_to_end(block_id, last=False)

    def release_out_of_window(self, seq: Sequence) -> None:
        """Hand back a running `seq`'s leading blocks that its next token's window (and so every later one's)
        starts after: a query at position i sees keys j > i - sliding_window. With prefix caching, only blocks
        already entered in it (their K/V stay findable until reused)."""
        if not self.sliding_window:
            return
        first_seen = seq.num_computed_tokens - self.sliding_window + 1
        keep_from = min(first_seen // self.block_size, len(seq.block_table) - 1)
        if self.enable_prefix_caching:
            keep_from = min(keep_from, seq.num_hashed_blocks)
        if keep_from <= seq.num_released_blocks:
            return
        held = seq.block_table[keep_from]  # read in their place, never weighed
        for i in range(seq.num_released_blocks, keep_from):
            self._release(seq.block_table[i])
            seq.block_table[i] = held
        seq.num_released_blocks = keep_from

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Give `child` the blocks of `parent` (its KV so far), shared."""
        for block_id in parent.block_table[parent.num_released_blocks:]:
            self.blocks[block_id].ref_count += 1
        child.block_table = list(parent.block_table)

    def can_append(self, seq: Sequence) -> bool:
        return self._needs_block(seq) <= self.num_free_blocks

    def _needs_block(self, seq: Sequence) -> int:
        """1 if the token at position num_tokens - 1 needs a block: a new one, or a copy of a shared one."""
        table, n = seq.block_table, seq.num_tokens
        if n > len(table) * self.block_size:
            return 1
        return int(self.blocks[table[(n - 1) // self.block_size]].ref_count > 1)

    def append_slot(self, seq: Sequence) -> None:
        """Make room for the token at position num_tokens - 1: a new block, or a copy of the shared block it
        falls in."""
        last = (seq.num_tokens - 1) // self.block_size
        if last >= len(seq.block_table):
            seq.block_table.append(self._take_free_block())
            return
        shared = self.blocks[seq.block_table[last]]
        if shared.ref_count > 1:
            copy = self._take_free_block()
            shared.ref_count -= 1
            seq.block_table[last] = copy
            self.pending_copies.append((shared.block_id, copy))

    def take_copies(self) -> list[tuple[int, int]]:
        """The block copies a step must make before its forward pass."""
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def register_computed(self, seq: Sequence) -> None:
        """Enter full blocks whose K/V are now computed into the prefix cache."""
        if not self.enable_prefix_caching:
            return
        num_full = min(seq.num_computed_tokens, seq.num_tokens) // self.block_size
        if num_full <= seq.num_hashed_blocks:
            return
        prefix_hash = seq.hashed_prefix
        for i in range(seq.num_hashed_blocks, num_full):
            tokens, image_key = seq.block(i), seq.block_image_key(i)
            prefix_hash = chain_hash(tokens, prefix_hash, image_key)
            block = self.blocks[seq.block_table[i]]
            block.hash = prefix_hash
            block.token_ids = tokens
            block.image_key = image_key
            self.hash_to_block_id[prefix_hash] = block.block_id
        seq.num_hashed_blocks = max(seq.num_hashed_blocks, num_full)
        seq.hashed_prefix = prefix_hash
