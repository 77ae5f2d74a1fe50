"""Embeddings on a GPU: the engine's default path (Triton attention, prefill CUDA graphs, async scheduling)
against sentence-transformers, and the embedding bench on the Qwen3-Embedding-0.6B shape."""
from __future__ import annotations

import json

import pytest
import torch
from test_embeddings import TEXTS, beside_generation, cosines, make_embedding_model, reference, vectors

from engine import LLM, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("pooling", ["lasttoken", "mean"])
def test_gpu_embeddings_equal_sentence_transformers(tmp_path, pooling):
    """bf16 on the GPU against sentence-transformers' float32 on the CPU."""
    least = 0.995
    model = make_embedding_model(tmp_path, pooling)
    ref = reference(model, TEXTS)
    texts = TEXTS * 40  # many requests: several per step, prefix-cache hits on the repeats (last token)
    llm = LLM(str(model), device="cuda", dtype="bfloat16", kvcache_block_size=16, max_num_batched_tokens=64,
              gpu_memory_utilization=0.3)
    try:
        outs = llm.embed(texts, use_tqdm=False)
        # beside generation: its tokens are those of the prompt alone
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        alone = llm.generate(["one two three"], params, use_tqdm=False)[0].token_ids
        [generated], embedded = beside_generation(llm, ["one two three"], params, TEXTS)
    finally:
        llm.shutdown()
    got = vectors(outs).view(40, len(TEXTS), -1)
    for i in range(40):
        assert min(cosines(got[i], ref)) > least
    assert generated.token_ids == alone
    assert min(cosines(vectors(embedded), ref)) > least
    if pooling == "lasttoken":  # a repeat finds its text's blocks (not the one admitted beside it: not yet entered)
        assert any(o.num_cached_tokens > 0 for o in outs[len(TEXTS):])


def test_gpu_embed_bench_on_the_qwen3_embedding_shape(capsys):
    from worker.cli import main
    assert main(["bench", "--embed", "--num-texts", "3000"]) == 0
    record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert record["model"] == "qwen3-embedding-0.6b" and record["num_texts"] == 3000
    if record["share_of_floor"] is not None:  # an H100 or H200: a floor to compare with
        assert 0 < record["share_of_floor"] < 1
