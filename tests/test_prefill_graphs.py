"""One sequence's prefill replayed as a CUDA graph of a padded token count (engine/execution/cuda_graphs.py).

The graphs themselves need CUDA (tests/test_gpu_engine.py); what they rely on runs here: a prefill
padded as fill_padded_prefill lays it out gives the real rows' hidden states of the unpadded prefill and
stores nothing for the padding.
"""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch

from engine import LLM
from engine.attention import AttentionMetadata
from engine.execution.cuda_graphs import (
    PREFILL_GRAPH_TOKENS,
    fill_padded_prefill,
    prefill_graph_size,
    prefill_graph_sizes,
)
from engine.execution.model_runner import StepInputs

BLOCK = 8


def test_a_prefill_takes_the_smallest_graph_that_holds_it():
    assert prefill_graph_size(2, PREFILL_GRAPH_TOKENS) == 16
    assert prefill_graph_size(16, PREFILL_GRAPH_TOKENS) == 16
    assert prefill_graph_size(17, PREFILL_GRAPH_TOKENS) == 32
    assert prefill_graph_size(2048, PREFILL_GRAPH_TOKENS) == 2048
    assert prefill_graph_size(2049, PREFILL_GRAPH_TOKENS) is None


def test_the_graphs_captured_are_those_within_the_token_budget_and_the_context():
    def sizes(budget, context):
        return prefill_graph_sizes(SimpleNamespace(max_num_batched_tokens=budget, max_model_len=context))
    assert sizes(16384, 4096) == PREFILL_GRAPH_TOKENS
    assert sizes(16384, 64) == [16, 32, 64]
    assert sizes(100, 4096) == [16, 32, 64]
    assert sizes(8, 4096) == []  # no graph: the runner keeps every prefill eager


def _chunk(tokens: list[int], start: int, end: int, table: list[int]) -> StepInputs:
    """The prefill of tokens[start:end] for one sequence whose first `start` tokens are in the cache."""
    positions = list(range(start, end))
    slots = [table[p // BLOCK] * BLOCK + p % BLOCK for p in positions]
    return StepInputs(
        input_ids=torch.tensor(tokens[start:end]), positions=torch.tensor(positions), slot_mapping=torch.tensor(slots),
        cu_seqlens_q=torch.tensor([0, len(positions)], dtype=torch.int32),
        seqlens_k=torch.tensor([end], dtype=torch.int32), block_tables=torch.tensor([table], dtype=torch.int32),
        max_seqlen_q=len(positions), max_seqlen_k=end, logits_indices=torch.tensor([len(positions) - 1]))


def _padded_forward(runner, inputs: StepInputs, size: int, max_blocks: int) -> torch.Tensor:
    """What a graph of `size` tokens computes for `inputs` (its rows past the sequence cut off)."""
    arrays = {"input_ids": np.zeros(size, np.int64), "positions": np.zeros(size, np.int64),
              "slot_mapping": np.zeros(size, np.int64), "cu_seqlens_q": np.zeros(2, np.int32),
              "seqlens_k": np.zeros(1, np.int32), "block_tables": np.zeros(max_blocks, np.int32)}
    fill_padded_prefill(arrays, inputs, size)
    t = {name: torch.from_numpy(a) for name, a in arrays.items()}
    runner.ctx.meta = AttentionMetadata(t["slot_mapping"], t["cu_seqlens_q"], t["seqlens_k"],
                                        t["block_tables"].view(1, max_blocks), size, 10_000, False,
                                        has_decode_rows=False)
    try:
        with torch.inference_mode():
            hidden = runner.model(t["input_ids"], t["positions"])
    finally:
        runner.ctx.meta = None
    return hidden[: len(inputs.input_ids)]


def test_a_prefill_padded_as_its_graph_holds_it_gives_the_unpadded_rows_and_stores_nothing_more(qwen3_checkpoint):
    llm = LLM(str(qwen3_checkpoint), device="cpu", dtype="float32", kvcache_block_size=BLOCK, num_kvcache_blocks=16,
              max_model_len=64, enforce_eager=True)
    runner = llm.runner
    # no NaN bit patterns from the allocation (unequal to themselves), and no zeros that a padding row's
    # K/V (token 0's embedding is zero in these checkpoints) would leave unchanged
    runner.kv_cache.fill_(7.0)
    rng = np.random.default_rng(5)
    tokens = rng.integers(3, 500, size=37).tolist()
    table = [9, 2, 14, 5, 11]  # not in order, as a block manager hands them out
    first, second = _chunk(tokens, 0, 21, table[:3]), _chunk(tokens, 21, 37, table)  # then over a cached prefix
    for inputs, size in ((first, 32), (second, 16), (second, 64)):
        with torch.inference_mode():
            unpadded = runner.forward(inputs)
        caches = [c.clone() for layer in runner.attn_layers for c in (layer.k_cache, layer.v_cache)]
        padded = _padded_forward(runner, inputs, size, max_blocks=8)
        assert padded.shape == unpadded.shape
        torch.testing.assert_close(padded, unpadded, rtol=1e-5, atol=1e-5)
        # the real rows store their K/V again (equal up to rounding); every other slot keeps its bytes
        written = torch.zeros(16 * BLOCK, dtype=torch.bool)
        written[inputs.slot_mapping] = True
        for before, after in zip(caches, (c for layer in runner.attn_layers for c in (layer.k_cache, layer.v_cache))):
            before, after = before.flatten(0, 1), after.flatten(0, 1)
            assert torch.equal(before[~written], after[~written]), "a padding row wrote into the KV cache"
            torch.testing.assert_close(after[written], before[written], rtol=1e-5, atol=1e-5)
