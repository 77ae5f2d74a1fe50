"""LLM.embed against sentence-transformers on tiny random Qwen3 embedding models saved as sentence-transformers
saves them (last-token, mean and CLS pooling, then Normalize), and the checkpoint layouts embedding models publish."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import make_checkpoint

from engine import LLM, SamplingParams

TEXTS = ["hello world", "the quick brown fox jumps over the lazy dog " * 6, "a",
         "hello world, and a little more after it"]


def make_embedding_model(root: Path, pooling: str, normalize: bool = True) -> Path:
    """A tiny Qwen3 saved through sentence-transformers (Transformer + Pooling [+ Normalize]): the bare
    decoder's tensors (no `model.` prefix, no lm_head), a tokenizer that appends <|endoftext|>, no chat template."""
    from sentence_transformers import SentenceTransformer, models

    base = make_checkpoint("qwen3", root / "base")
    tok = json.loads((base / "tokenizer.json").read_text())
    eot = next(a["id"] for a in tok["added_tokens"] if a["content"] == "<|endoftext|>")
    seq, end = {"Sequence": {"id": "A", "type_id": 0}}, {"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}}
    tok["post_processor"] = {"type": "TemplateProcessing", "single": [seq, end],
                             "pair": [seq, {"Sequence": {"id": "B", "type_id": 1}}, end],
                             "special_tokens": {"<|endoftext|>": {"id": "<|endoftext|>", "ids": [eot],
                                                                  "tokens": ["<|endoftext|>"]}}}
    (base / "tokenizer.json").write_text(json.dumps(tok))
    (base / "chat_template.jinja").unlink()  # embedding models' text is tokenized as it is
    transformer = models.Transformer(str(base))
    modules = [transformer, models.Pooling(transformer.get_word_embedding_dimension(), pooling_mode=pooling)]
    if normalize:
        modules.append(models.Normalize())
    out = root / f"st-{pooling}"
    SentenceTransformer(modules=modules, device="cpu").save(str(out))
    return out


@pytest.fixture(scope="module", params=["lasttoken", "mean", "cls"])
def st_model(request, tmp_path_factory) -> Path:
    return make_embedding_model(tmp_path_factory.mktemp(request.param), request.param)


def reference(model_dir: Path, texts: list[str]) -> torch.Tensor:
    from sentence_transformers import SentenceTransformer
    return SentenceTransformer(str(model_dir), device="cpu").encode(texts, convert_to_tensor=True).float()


def vectors(outs) -> torch.Tensor:
    return torch.tensor([o.embedding for o in outs])


def cosines(a: torch.Tensor, b: torch.Tensor) -> list[float]:
    return torch.nn.functional.cosine_similarity(a, b).tolist()


def test_embeddings_equal_sentence_transformers_with_chunks_and_prefix_cache_hits(st_model):
    ref = reference(st_model, TEXTS)
    # 16-token blocks, 32-token steps: the long text's prompt is prefilled in chunks
    llm = LLM(str(st_model), device="cpu", kvcache_block_size=16, max_num_batched_tokens=32)
    try:
        first = llm.embed(TEXTS, use_tqdm=False)
        again = llm.embed(TEXTS, use_tqdm=False)  # the same prompts: their full blocks are in the prefix cache
    finally:
        llm.shutdown()
    assert len(first) == len(TEXTS) and all(o.finished and o.finish_reason == "stop" for o in first)
    assert min(cosines(vectors(first), ref)) > 0.9999
    assert min(cosines(vectors(again), ref)) > 0.9999
    long_cached = again[1].num_cached_tokens
    if st_model.name == "st-lasttoken":
        assert long_cached >= 32  # served from the cache, the last token computed
    else:
        assert long_cached == 0  # mean and CLS pooling need positions a cache hit skips
    assert first[0].prompt_token_ids[-1] == first[2].prompt_token_ids[-1]  # <|endoftext|> appended and pooled


def test_dimensions_truncate_and_renormalise_and_bad_ones_are_refused(st_model):
    llm = LLM(str(st_model), device="cpu")
    try:
        full = vectors(llm.embed(TEXTS[:2], use_tqdm=False))
        short = vectors(llm.embed(TEXTS[:2], dimensions=16, use_tqdm=False))
        for bad in (0, 65, "16", True, 1.5):
            with pytest.raises(ValueError, match=r"dimensions must be an integer in \[1, 64\]"):
                llm.embed(TEXTS[:1], dimensions=bad, use_tqdm=False)
        ids = llm.embed([llm.embed(TEXTS[:1], use_tqdm=False)[0].prompt_token_ids], use_tqdm=False)
        assert not llm.has_unfinished()
    finally:
        llm.shutdown()
    assert short.shape == (2, 16)
    assert torch.allclose(short, torch.nn.functional.normalize(full[:, :16], dim=1), atol=1e-6)
    assert torch.allclose(short.norm(dim=1), torch.ones(2), atol=1e-6)
    assert torch.allclose(vectors(ids), full[:1], atol=1e-6)  # token ids embed as the text they spell


def test_published_layout_loads_and_refuses_to_generate_without_an_lm_head(tmp_path):
    """Qwen3-Embedding as published: a Qwen3Model's tensors under a config naming Qwen3ForCausalLM, untied
    (the larger ones) so there is no LM head at all."""
    model = make_embedding_model(tmp_path, "lasttoken")
    config = json.loads((model / "config.json").read_text())
    config.update(architectures=["Qwen3ForCausalLM"], tie_word_embeddings=False)
    (model / "config.json").write_text(json.dumps(config))
    ref = reference(model, TEXTS[:2])
    llm = LLM(str(model), device="cpu")
    try:
        assert min(cosines(vectors(llm.embed(TEXTS[:2], use_tqdm=False)), ref)) > 0.9999
        with pytest.raises(ValueError, match="has no LM head .* use embed"):
            llm.generate(["hi"], SamplingParams(max_tokens=2), use_tqdm=False)
    finally:
        llm.shutdown()


def test_without_sentence_transformers_files_the_last_token_is_pooled_and_normalised(tmp_path):
    import transformers as tf
    ckpt = make_checkpoint("qwen3", tmp_path / "plain")
    llm = LLM(str(ckpt), device="cpu")
    try:
        out = llm.embed(TEXTS[0], use_tqdm=False)[0]
    finally:
        llm.shutdown()
    hf = tf.AutoModel.from_pretrained(ckpt).eval()
    with torch.no_grad():
        last = hf(torch.tensor([out.prompt_token_ids])).last_hidden_state[0, -1]
    assert cosines(torch.tensor([out.embedding]), last[None])[0] > 0.9999
    assert abs(torch.tensor(out.embedding).norm().item() - 1.0) < 1e-5


@pytest.mark.parametrize("config, error", [
    ({"pooling_mode": "max"}, "pools by max"),
    ({"pooling_mode_mean_tokens": True, "pooling_mode_cls_token": True}, "pools by mean\\+cls"),
    ({"pooling_mode": "lasttoken", "include_prompt": False}, "include_prompt"),
])
def test_a_pooling_the_engine_does_not_compute_is_refused_in_one_line(tmp_path, config, error):
    ckpt = make_checkpoint("qwen3", tmp_path / "m")
    (ckpt / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))
    (ckpt / "1_Pooling").mkdir()
    (ckpt / "1_Pooling" / "config.json").write_text(json.dumps(config))
    llm = LLM(str(ckpt), device="cpu")
    try:
        with pytest.raises(ValueError, match=error):
            llm.embed(["x"], use_tqdm=False)
    finally:
        llm.shutdown()


def test_legacy_pooling_config_reads_as_published():
    """Qwen3-Embedding's 1_Pooling/config.json uses sentence-transformers' older boolean keys."""
    from engine.core.pooling import _pooling_method
    legacy = {"word_embedding_dimension": 1024, "pooling_mode_cls_token": False, "pooling_mode_mean_tokens": False,
              "pooling_mode_max_tokens": False, "pooling_mode_mean_sqrt_len_tokens": False,
              "pooling_mode_weightedmean_tokens": False, "pooling_mode_lasttoken": True, "include_prompt": True}
    assert _pooling_method(legacy) == "lasttoken"


def beside_generation(llm, prompts: list[str], params: SamplingParams, texts: list[str]) -> tuple[list, list]:
    """Generation requests of `prompts` and embedding requests of `texts`, added together and stepped to the end:
    (the generations' outputs, the embeddings' outputs), each in order."""
    gen_ids = [llm.add_request(p, params) for p in prompts]
    emb_ids = [llm.add_embed_request(t) for t in texts]
    done = {}
    while llm.has_unfinished():
        for out in llm.step().finished:
            done[out.request_id] = out
    return [done[r] for r in gen_ids], [done[r] for r in emb_ids]


def test_embedding_requests_beside_generation_leave_its_tokens_unchanged(tmp_path):
    """Embedding rows are pooled and never sampled: generated tokens are those of the same prompts alone. Async
    scheduling, as on GPUs: pooled sums are collected a step after their launch, with sampled tokens in flight."""
    model = make_embedding_model(tmp_path, "mean")
    prompts = ["one two three", "four five six seven"]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    llm = LLM(str(model), device="cpu", kvcache_block_size=16, max_num_batched_tokens=24, async_scheduling=True)
    try:
        alone = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        ref = vectors(llm.embed(TEXTS, use_tqdm=False))
        generated, embedded = beside_generation(llm, prompts, params, TEXTS)
    finally:
        llm.shutdown()
    assert [o.token_ids for o in generated] == alone
    assert min(cosines(vectors(embedded), ref)) > 0.9999


def test_embed_bench_runs_and_its_floor_counts_the_multiplied_parameters(capsys):
    from engine.config import load_hf_config
    from worker import bench_embed, bench_engine
    from worker.cli import main
    assert main(["bench", "--embed", "--model", "tiny", "--num-texts", "24", "--max-text-len", "80",
                 "--device", "cpu"]) == 0
    record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert record["workload"] == "embed" and record["num_texts"] == 24 and record["tokens"] >= 24 * 50
    shape = load_hf_config(bench_engine.resolve_model("qwen3-embedding-0.6b"))
    assert shape.architectures == ["Qwen3ForCausalLM"] and shape.hidden_size == 1024
    multiplied = bench_engine.count_parameters(shape) - shape.vocab_size * shape.hidden_size
    assert 430e6 < multiplied < 450e6  # Qwen3-0.6B's decoder: 0.44 B parameters outside its embedding table
    assert bench_embed.floor_seconds(shape, 1_000_000, 1e15) == pytest.approx(2 * multiplied * 1e6 / 1e15)


def test_tensor_parallel_embeddings_equal_one_rank(tmp_path):
    """Rank 0 pools its whole hidden states; the other ranks get no pooled rows. Async scheduling too."""
    model = make_embedding_model(tmp_path, "mean")
    ref = reference(model, TEXTS)
    llm = LLM(str(model), device="cpu", tensor_parallel_size=2, kvcache_block_size=16, max_num_batched_tokens=32,
              async_scheduling=True)
    try:
        outs = llm.embed(TEXTS, use_tqdm=False)
    finally:
        llm.shutdown()
    assert min(cosines(vectors(outs), ref)) > 0.9999


def test_an_aborted_embedding_request_reports_abort_without_a_vector(st_model):
    llm = LLM(str(st_model), device="cpu", kvcache_block_size=16, max_num_batched_tokens=16)
    try:
        rid = llm.add_embed_request(TEXTS[1])  # several chunks: still running after one step
        llm.step()
        assert llm.abort(rid)
        outs = [o for o in llm.step().outputs if o.request_id == rid]
        assert not llm.has_unfinished()
        again = llm.embed(TEXTS[1], use_tqdm=False)[0]
    finally:
        llm.shutdown()
    assert [(o.finished, o.finish_reason, o.embedding) for o in outs] == [(True, "abort", None)]
    assert again.finish_reason == "stop" and len(again.embedding) == 64


def test_a_corpus_larger_than_the_engine_window_comes_back_in_order(st_model):
    texts = [f"text number {i} " * (1 + i % 5) for i in range(40)]
    ref = reference(st_model, texts)
    llm = LLM(str(st_model), device="cpu", max_num_seqs=2)  # 8 requests in the engine at once
    try:
        outs = llm.embed(texts, use_tqdm=False)
        with pytest.raises(ValueError, match="outside the vocabulary"):
            llm.embed(texts[:20] + [[10**6]], use_tqdm=False)  # a bad input late in the corpus
        assert not llm.has_unfinished() and not llm.requests
    finally:
        llm.shutdown()
    assert min(cosines(vectors(outs), ref)) > 0.9999
