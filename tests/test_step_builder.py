"""The step builder's prefill inputs, built per step in numpy, against the per-token definitions: each input row's
token, position (LongRoPE's rows shifted), KV slot through its sequence's block table, the query offsets, the key
lengths, the padded block tables, the sampled and pooled rows, over random batches of chunked, cached and
finished-prompt sequences."""
from __future__ import annotations

import random

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.core.pooling import PooledState, Pooling, pooled_positions
from engine.core.scheduler import ScheduledBatch
from engine.core.sequence import Sequence
from engine.core.step_builder import StepBuilder
from engine.sampling.params import SamplingParams

BLOCK = 4
LONG_ROPE_ROW = 1000


def _batch(rng: random.Random, num_seqs: int) -> ScheduledBatch:
    seqs, counts, free = [], [], list(range(200))
    rng.shuffle(free)
    for _ in range(num_seqs):
        seq = Sequence([rng.randrange(1, 500) for _ in range(rng.randint(1, 30))], SamplingParams(), BLOCK)
        seq.block_table = [free.pop() for _ in range(-(-seq.num_tokens // BLOCK))]
        seq.num_computed_tokens = rng.randrange(seq.num_tokens)  # a cached prefix or earlier chunks
        seq.long_rope = rng.random() < 0.3
        if rng.random() < 0.3:
            seq.pooling = PooledState(Pooling(rng.choice(["lasttoken", "mean", "cls"]), True), None)
        seqs.append(seq)
        counts.append(rng.randint(1, seq.num_tokens - seq.num_computed_tokens))
    return ScheduledBatch(seqs, counts)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), num_seqs=st.integers(1, 6))
def test_prefill_inputs_follow_the_per_token_definitions(seed, num_seqs):
    batch = _batch(random.Random(seed), num_seqs)
    if all(n == 1 and s.num_uncomputed_tokens == 1 and s.pooling is None for s, n in zip(batch.seqs, batch.num_tokens)):
        return  # a decode step: built by _decode_inputs
    inputs = StepBuilder(BLOCK, False, 500, [2], long_rope_row=LONG_ROPE_ROW).build(batch, batch.sampled())
    ids, positions, slots, cu, logits, pooled = [], [], [], [0], [], []
    for seq, n in zip(batch.seqs, batch.num_tokens):
        start = seq.num_computed_tokens
        for p in range(start, start + n):
            ids.append(seq.token_ids[p])
            positions.append(p + (LONG_ROPE_ROW if seq.long_rope else 0))
            slots.append(seq.block_table[p // BLOCK] * BLOCK + p % BLOCK)
        if seq.pooling is not None:
            pooled += [cu[-1] + p - start for p in pooled_positions(seq.pooling.pooling.method, start, start + n,
                                                                     seq.num_tokens)]
        elif start + n == seq.num_tokens:
            logits.append(cu[-1] + n - 1)
        cu.append(cu[-1] + n)
    width = max(len(s.block_table) for s in batch.seqs)
    assert inputs.input_ids.tolist() == ids and inputs.input_ids.dtype == torch.int64
    assert inputs.positions.tolist() == positions and inputs.positions.dtype == torch.int64
    assert inputs.slot_mapping.tolist() == slots and inputs.slot_mapping.dtype == torch.int64
    assert inputs.cu_seqlens_q.tolist() == cu and inputs.cu_seqlens_q.dtype == torch.int32
    assert inputs.seqlens_k.tolist() == [s.num_computed_tokens + n for s, n in zip(batch.seqs, batch.num_tokens)]
    assert inputs.block_tables.tolist() == [s.block_table + [-1] * (width - len(s.block_table)) for s in batch.seqs]
    assert inputs.block_tables.dtype == inputs.seqlens_k.dtype == torch.int32
    assert (inputs.max_seqlen_q, inputs.max_seqlen_k) == (max(batch.num_tokens), max(inputs.seqlens_k.tolist()))
    assert inputs.logits_indices.tolist() == logits
    assert (inputs.pooled_rows.tolist() if inputs.pooled_rows is not None else []) == pooled
