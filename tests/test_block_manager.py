import pytest

from engine.core.block_manager import BlockManager
from engine.core.sequence import Sequence
from engine.sampling.params import SamplingParams

BS = 4


def seq(tokens):
    return Sequence(tokens, SamplingParams(), BS)


def compute_all(bm, s):
    s.num_computed_tokens = s.num_tokens
    bm.register_computed(s)


def test_ref_counts_and_hash_reuse_across_sequences():
    bm = BlockManager(16, BS)
    a = seq(list(range(10)))               # 2 full blocks + 2 tokens
    bm.allocate(a)
    assert len(a.block_table) == 3 and a.num_cached_tokens == 0
    compute_all(bm, a)
    b = seq(list(range(8)) + [99, 98, 97])
    bm.allocate(b)
    assert b.block_table[:2] == a.block_table[:2]
    assert b.num_cached_tokens == 8 and b.num_computed_tokens == 8
    assert [bm.blocks[i].ref_count for i in a.block_table] == [2, 2, 1]
    bm.free(a)
    assert [bm.blocks[i].ref_count for i in b.block_table[:2]] == [1, 1]
    bm.free(b)
    assert bm.num_free_blocks == bm.num_blocks


def test_full_prompt_hit_still_computes_last_token():
    bm = BlockManager(8, BS)
    a = seq(list(range(8)))
    bm.allocate(a)
    compute_all(bm, a)
    bm.free(a)
    b = seq(list(range(8)))
    bm.allocate(b)
    assert b.num_cached_tokens == 4  # the last block holds the last token, so it is recomputed
    assert b.num_uncomputed_tokens == 4


def test_different_prefix_same_block_tokens_does_not_hit():
    bm = BlockManager(8, BS)
    a = seq([1, 2, 3, 4, 5, 6, 7, 8, 9])
    bm.allocate(a)
    compute_all(bm, a)
    b = seq([0, 0, 0, 0, 5, 6, 7, 8, 9])   # second block equal, first differs
    bm.allocate(b)
    assert b.num_cached_tokens == 0


def test_uncomputed_blocks_are_never_served_from_cache():
    bm = BlockManager(8, BS)
    a = seq(list(range(9)))
    bm.allocate(a)                          # allocated but nothing computed yet
    b = seq(list(range(9)))
    bm.allocate(b)
    assert b.num_cached_tokens == 0


def test_lru_eviction_keeps_recent_prefixes():
    bm = BlockManager(6, BS)
    seqs = [seq([10 * k + i for i in range(5)]) for k in range(3)]  # each: 1 full block + 1 partial
    for s in seqs:
        bm.allocate(s)
        compute_all(bm, s)
    for s in seqs:                          # freed oldest first: cached blocks in LRU order
        bm.free(s)
    # 3 partial (uncached) blocks are reused first, then the oldest cached block
    fresh = seq(list(range(100, 116)))      # needs 4 blocks
    bm.allocate(fresh)
    survivors = [seq([10 * k + i for i in range(5)]) for k in range(3)]
    hits = []
    for s in survivors:
        hits.append(bm.can_allocate(s) and bm._cached_prefix(s) != [])
    assert hits == [False, True, True]


def test_touching_a_cached_prefix_makes_it_recent():
    bm = BlockManager(4, BS)
    a, b = seq([1, 1, 1, 1, 0]), seq([2, 2, 2, 2, 0])
    for s in (a, b):
        bm.allocate(s)
        compute_all(bm, s)
    bm.free(a)
    bm.free(b)
    a2 = seq([1, 1, 1, 1, 7])               # reuses a's cached block, then frees it again: now the newest
    bm.allocate(a2)
    assert a2.num_cached_tokens == 4
    bm.free(a2)
    filler = seq(list(range(50, 62)))       # takes 2 uncached blocks + the least recently used cached one
    bm.allocate(filler)
    assert bm._cached_prefix(seq([1, 1, 1, 1, 9])) != []
    assert bm._cached_prefix(seq([2, 2, 2, 2, 9])) == []


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_no_block_leaks_after_finish_and_abort(async_scheduling):
    from engine import LLM
    from engine import SamplingParams as SP
    from engine.builtin import TINY_MODEL_DIR
    llm = LLM(TINY_MODEL_DIR, load_format="dummy", device="cpu", kvcache_block_size=4, num_kvcache_blocks=64,
              max_model_len=128, async_scheduling=async_scheduling)
    ids = [llm.add_request([5 + i] * (3 + 2 * i), SP(temperature=0, max_tokens=10 + i)) for i in range(8)]
    llm.step()
    llm.step()
    assert llm.abort(ids[0]) and llm.abort(ids[5])
    reasons = {}
    while llm.has_unfinished():
        for out in llm.step().finished:
            reasons[out.request_id] = out.finish_reason
    assert reasons[ids[0]] == reasons[ids[5]] == "abort"
    assert sorted(reasons) == sorted(ids)
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks


def test_forked_sequences_share_blocks_and_copy_the_partial_one_before_writing():
    bm = BlockManager(8, BS)
    parent = seq(list(range(6)))           # 1 full block + 2 tokens in the second
    bm.allocate(parent)
    compute_all(bm, parent)
    child = parent.fork(1)
    bm.fork(parent, child)
    assert child.block_table == parent.block_table
    assert [bm.blocks[i].ref_count for i in parent.block_table] == [2, 2]
    shared = parent.block_table[1]
    for s, token in ((parent, 50), (child, 60)):  # each writes position 6, in the shared partial block
        s.append_token(token)
        assert bm.can_append(s)
        bm.append_slot(s)
    # the first writer took a copy; the last holder writes in place
    assert parent.block_table[1] != shared and child.block_table[1] == shared
    assert bm.take_copies() == [(shared, parent.block_table[1])] and bm.take_copies() == []
    assert parent.block_table[0] == child.block_table[0] and bm.blocks[parent.block_table[0]].ref_count == 2
    bm.free(parent)
    bm.free(child)
    assert bm.num_free_blocks == bm.num_blocks
    assert all(b.ref_count == 0 for b in bm.blocks)


def test_a_fork_at_a_block_boundary_copies_nothing():
    bm = BlockManager(8, BS)
    parent = seq(list(range(8)))           # two full blocks
    bm.allocate(parent)
    compute_all(bm, parent)
    child = parent.fork(1)
    bm.fork(parent, child)
    for s in (parent, child):
        s.append_token(9)
        bm.append_slot(s)
    assert bm.take_copies() == []
    assert parent.block_table[:2] == child.block_table[:2] and parent.block_table[2] != child.block_table[2]


def test_copy_on_write_needs_a_free_block():
    bm = BlockManager(2, BS)
    parent = seq([1, 2, 3])
    bm.allocate(parent)
    child = parent.fork(1)
    bm.fork(parent, child)
    bm.allocate(seq([7]))                  # the last free block
    child.append_token(4)
    assert not bm.can_append(child)


def test_blocks_before_the_window_are_handed_back_once_cached_and_never_serve_a_prefix_after_reuse():
    bm = BlockManager(8, BS, sliding_window=3)
    a = seq(list(range(14)))               # 3 full blocks + 2 tokens; the next query (position 14) sees 12..14
    bm.allocate(a)
    a.num_computed_tokens = 14
    bm.release_out_of_window(a)
    assert a.num_released_blocks == 0      # not yet in the prefix cache
    bm.register_computed(a)
    held = a.block_table[3]
    released = a.block_table[:3]
    bm.release_out_of_window(a)
    assert a.num_released_blocks == 3 and a.block_table == [held] * 4
    assert bm.num_free_blocks == 7 and all(bm.blocks[b].ref_count == 0 for b in released)
    # while cached, the handed-back blocks serve the same prompt from its first block
    c = seq(list(range(12)) + [50, 51])
    assert bm._cached_prefix(c) == released
    # reused by another sequence (the never-cached blocks go first, then these), they serve nothing
    d = seq(list(range(100, 128)))
    bm.allocate(d)
    assert set(released) <= set(d.block_table)
    assert bm._cached_prefix(c) == []
    bm.free(a)
    bm.free(d)
    assert bm.num_free_blocks == bm.num_blocks


def test_long_rope_blocks_chain_from_their_own_root():
    """A sequence longer than long_rope_after rotates with LongRoPE's long factors: its blocks never serve a short
    sequence's prefix, nor a short one's blocks a long one's."""
    bm = BlockManager(16, BS, long_rope_after=10)
    short = seq(list(range(9)))
    bm.allocate(short)
    compute_all(bm, short)
    long = seq(list(range(9)) + list(range(50, 60)))
    bm.allocate(long)
    assert long.long_rope and not short.long_rope and long.num_cached_tokens == 0
    compute_all(bm, long)
    other_long = seq(list(range(9)) + list(range(70, 80)))
    bm.allocate(other_long)
    assert other_long.num_cached_tokens == 8 and other_long.block_table[:2] == long.block_table[:2]
    short.append_token(5), short.append_token(6)
    assert bm.rotates_anew(short) and not bm.rotates_anew(long)
