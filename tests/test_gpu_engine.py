"""bf16 engine on the GPU against transformers bf16 on the same checkpoint (run on a GPU machine)."""
from __future__ import annotations

import gc
import random

import pytest
import torch

from engine import LLM, SamplingParams
from engine.execution.model_runner import prefill_inputs
from tests.conftest import make_checkpoint

pytestmark = pytest.mark.gpu
MAX_NEW = 16


@pytest.fixture(scope="module", params=[dict(head_dim=64, num_attention_heads=8, num_key_value_heads=2),
                                        dict(head_dim=128, num_attention_heads=8, num_key_value_heads=8)],
                ids=["gqa4-d64", "mha-d128"])
def gpu_checkpoint(request, tmp_path_factory):
    shape = dict(hidden_size=512, intermediate_size=1024, num_hidden_layers=4, initializer_range=0.05,
                 **request.param)
    return make_checkpoint("qwen3", tmp_path_factory.mktemp("gpu-qwen3"), **shape)


@pytest.fixture(scope="module")
def hf_model(gpu_checkpoint):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(gpu_checkpoint, dtype=torch.bfloat16).cuda().eval()


@pytest.fixture(scope="module")
def hf_fp32(gpu_checkpoint):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(gpu_checkpoint, dtype=torch.float32).cuda().eval()


def _prompts(n=32, seed=3):
    rng = random.Random(seed)
    shared = [rng.randrange(3, 500) for _ in range(300)]
    return [(shared if i % 2 else []) + [rng.randrange(3, 500) for _ in range(rng.randint(5, 400))] for i in range(n)]


@pytest.mark.parametrize("fused", [True, False], ids=["compiled", "eager-ops"])
def test_prompt_logits_match_transformers_bf16(gpu_checkpoint, hf_model, hf_fp32, fused):
    llm = LLM(str(gpu_checkpoint), device="cuda", dtype="bfloat16", kvcache_block_size=16,
              num_kvcache_blocks=512, enforce_eager=True, fused_layers=fused)
    runner = llm.runner
    errors = []
    for prompt in _prompts(6):
        inputs = prefill_inputs([prompt], 16, -(-len(prompt) // 16))
        inputs.logits_indices = torch.arange(len(prompt))
        ids = torch.tensor([prompt], device="cuda")
        with torch.inference_mode():
            ours = runner.compute_logits(runner.forward(inputs), inputs)
            exact = hf_fp32(ids).logits[0]
            ref = hf_model(ids).logits[0].float()
        rel = float((ours - ref).norm() / ref.norm())
        errors.append((len(prompt), rel, float((ours - exact).norm() / exact.norm()),
                       float((ref - exact).norm() / exact.norm())))
    print("prompt len, vs HF bf16, ours vs fp32, HF bf16 vs fp32:", errors)
    worst = max(errors, key=lambda e: e[1])
    assert worst[1] < 1e-2, f"prompt of {worst[0]} tokens: relative error {worst[1]:.2e} ({errors})"


@pytest.mark.parametrize("engine_kwargs", [
    dict(),                                                           # CUDA graphs, prefix cache
    dict(max_num_batched_tokens=256, num_kvcache_blocks=48, kvcache_block_size=16, max_model_len=768),  # chunked, preempted
    dict(max_num_seqs=2),                       # decode batches of <= 2 rows: the GEMV projections, PDL chain
    dict(max_num_seqs=16, gemv_rows=16),        # 3..16 rows: the GEMV's tensor-core kernel
    dict(tma_min_rows=1),                       # past the GEMV's rows, the TMA GEMM (Hopper) instead of cuBLAS
], ids=["graphs", "chunked-preempted", "small-batches", "dot-gemv-batches", "tma-gemm-batches"])
def test_greedy_tokens_equal_transformers_bf16_up_to_near_ties(gpu_checkpoint, hf_model, engine_kwargs, free_gpu,
                                                               monkeypatch):
    """bf16 rounding differs between any two implementations, so on a random model's flat logits two
    greedy runs part at near-ties. Most sequences must agree in full, and where one parts, the two
    tokens must be a near-tie for transformers itself on the shared prefix."""
    from engine.kernels import gemv, tma_gemm

    engine_kwargs = dict(engine_kwargs)
    if "gemv_rows" in engine_kwargs:
        monkeypatch.setattr(gemv, "MAX_ROWS", engine_kwargs.pop("gemv_rows"))
    if "tma_min_rows" in engine_kwargs:
        monkeypatch.setattr(tma_gemm, "MIN_ROWS", engine_kwargs.pop("tma_min_rows"))
    prompts = _prompts()
    llm = LLM(str(gpu_checkpoint), device="cuda", dtype="bfloat16", **{"max_model_len": 1024, **engine_kwargs})
    greedy = SamplingParams(temperature=0, max_tokens=MAX_NEW)
    llm.generate(prompts[:8], greedy, use_tqdm=False)  # so the batch below finds cached prefixes
    outs = llm.generate(prompts, greedy, use_tqdm=False)
    assert llm.block_manager.num_cache_hits > 0
    if "num_kvcache_blocks" in engine_kwargs:
        assert llm.scheduler.num_preemptions > 0
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks
    del llm
    assert_greedy_agrees_but_at_near_ties(hf_model, prompts, outs, MAX_NEW)


def _tokens_under_each(gpu_checkpoint, variants: dict, prompts, check=None,
                       **engine_kwargs) -> dict[str, list[list[int]]]:
    """Tokens of sampled (seeded) and greedy requests, alternating, from an engine with CUDA graphs built
    under each variant: {name: [(module, attribute, replacement), ...]}, an empty list for the engine as it
    is; check(llm, name) runs on each engine first."""
    params = [SamplingParams(temperature=0 if i % 2 else 0.8, seed=i, max_tokens=MAX_NEW)
              for i in range(len(prompts))]
    tokens = {}
    for name, replacements in variants.items():
        with pytest.MonkeyPatch.context() as patch:
            for module, attribute, value in replacements:
                patch.setattr(module, attribute, value)
            llm = LLM(str(gpu_checkpoint), device="cuda", dtype="bfloat16", max_model_len=1024, **engine_kwargs)
            assert llm.runner.graphs is not None
            if check is not None:
                check(llm, name)
            tokens[name] = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
            del llm
            gc.collect()
    return tokens


def test_programmatic_dependent_launch_keeps_every_token(gpu_checkpoint, monkeypatch, free_gpu):
    """PDL changes when the decode kernels start, never what they compute: with CUDA graphs and small
    batches (GEMV projections, here up to 8 rows), sampled (seeded) and greedy tokens equal those of the
    same kernels launched without it."""
    from engine.kernels import gemv, launch

    monkeypatch.setattr(gemv, "MAX_ROWS", 8)
    tokens = _tokens_under_each(gpu_checkpoint, {"pdl": [], "no_pdl": [(launch, "device_has_pdl", lambda i: False)]},
                                _prompts(n=24, seed=5), max_num_seqs=8)
    assert tokens["pdl"] == tokens["no_pdl"]


def test_graph_edges_opened_at_launch_keep_every_token(gpu_checkpoint, monkeypatch, free_gpu):
    """Edges opened at launch let the PDL kernels after cuBLAS's GEMMs in earlier, never change what they
    compute: sampled (seeded) and greedy tokens equal those of the graphs as captured, and the graphs of
    batches past the GEMV's rows had edges moved (from the GEMMs; cuBLAS computes every projection here,
    none the TMA GEMM, whose kernels start their successors themselves)."""
    from engine.execution import graph_edges
    from engine.kernels import gemv, tma_gemm

    monkeypatch.setattr(tma_gemm, "MAX_ROWS", 0)

    def check(llm, variant):
        moved = llm.runner.graphs.edges_moved
        if variant == "opened":
            past_gemv = [bs for bs in llm.runner.graphs.sizes if bs > gemv.MAX_ROWS]
            assert past_gemv and all(sum(moved[bs].values()) > 0 for bs in past_gemv), moved
        else:
            assert not any(moved.values()), moved

    tokens = _tokens_under_each(gpu_checkpoint, {"opened": [], "captured": [(graph_edges, "to_open_at_launch",
                                                                            lambda edges, scope="all": [])]},
                                _prompts(n=32, seed=11), check=check, max_num_seqs=32)
    assert tokens["opened"] == tokens["captured"]


def test_graph_edges_past_the_rows_limit_keep_every_token(gpu_checkpoint, monkeypatch, free_gpu):
    """Past ALL_EDGES_MAX_ROWS (here 4) only the edges from the GEMMs into the norms and SiLU·mul open at
    launch: those graphs had edges moved, and the tokens equal those of the same graphs as captured."""
    from engine.execution import graph_edges
    from engine.kernels import tma_gemm

    monkeypatch.setattr(tma_gemm, "MAX_ROWS", 0)
    monkeypatch.setattr(graph_edges, "ALL_EDGES_MAX_ROWS", 4)
    open_at_launch = graph_edges.to_open_at_launch

    def small_scope_captured(edges, scope="all"):
        return open_at_launch(edges, scope) if scope == "all" else []

    def check(llm, variant):
        moved = llm.runner.graphs.edges_moved
        past = [bs for bs in llm.runner.graphs.sizes if bs > 4]
        assert past, llm.runner.graphs.sizes
        if variant == "small":
            assert all(sum(moved[bs].values()) > 0 for bs in past), moved
        else:
            assert not any(moved.get(bs) for bs in past), moved

    tokens = _tokens_under_each(gpu_checkpoint, {"small": [], "captured": [(graph_edges, "to_open_at_launch",
                                                                           small_scope_captured)]},
                                _prompts(n=32, seed=13), check=check, max_num_seqs=32)
    assert tokens["small"] == tokens["captured"]


def test_an_engine_dropped_without_shutdown_leaves_the_next_one_its_kv_cache(gpu_checkpoint, free_gpu):
    """A process that drops an engine (del, no shutdown) and builds another gets a KV cache of the same size.
    The dropped engine's cache stays in torch's caching allocator once collected; were the new engine's
    weights carved out of that segment, it could not go back to the driver and the new engine would size
    its cache from the few GiB left (13 blocks instead of ~18,000 on an H100)."""
    blocks = []
    for _ in range(2):
        llm = LLM(str(gpu_checkpoint), device="cuda", dtype="bfloat16", max_model_len=1024, max_num_seqs=4,
                  enforce_eager=True)
        blocks.append(llm.runner.num_kvcache_blocks)
        del llm
        gc.collect()
    assert blocks[1] >= 0.95 * blocks[0], blocks


def test_decode_graphs_that_sample_give_the_tokens_of_eager_steps(gpu_checkpoint, free_gpu):
    """On one GPU the decode graphs hold the LM head and the sampler, take the previous step's tokens from
    the device and read the seed from their input buffer. Batches of captured sizes (1 and 4 rows, so
    eager steps multiply matrices of the same shapes) give the tokens of enforce_eager, for Gumbel-max
    sampling (in the graph), greedy (in the graph), and top-p with logprobs (sampled from the graph's
    logits), one after the other on each engine."""
    prompts = _prompts(n=4, seed=9)
    runs = [(prompts[:1], SamplingParams(temperature=0.8, max_tokens=MAX_NEW)),
            (prompts, SamplingParams(temperature=0.8, max_tokens=MAX_NEW)),
            (prompts, SamplingParams(temperature=0, max_tokens=MAX_NEW)),
            (prompts, SamplingParams(temperature=1.0, top_p=0.9, logprobs=2, max_tokens=MAX_NEW))]
    results = {}
    for eager in (True, False):
        llm = LLM(str(gpu_checkpoint), device="cuda", dtype="bfloat16", max_model_len=1024, max_num_seqs=4,
                  enforce_eager=eager)
        assert (llm.runner.graphs is None) == eager
        if not eager:
            assert llm.runner.graphs.samples
        results[eager] = [[(o.token_ids, [round(lp["logprob"], 3) for lp in o.logprobs or []])
                           for o in llm.generate(p, sp, use_tqdm=False)] for p, sp in runs]
        del llm
        gc.collect()
    assert results[False] == results[True]
    assert len({tuple(t) for t, _ in results[False][1]}) > 1, "four prompts sampled four times alike"


def test_prefill_graphs_give_the_logits_of_eager_prefills(gpu_checkpoint, free_gpu):
    """On one GPU a lone sequence's prefill replays a CUDA graph of its token count padded to a captured
    size. Its logits match the eager prefill's on the same engine (the padded projections may round
    differently: within bf16 noise), for whole prompts and for a prompt's tail over its cached prefix,
    and generations of one prompt at a time take the graphs."""
    from engine.execution.model_runner import StepInputs

    llm = LLM(str(gpu_checkpoint), device="cuda", dtype="bfloat16", max_model_len=1024, max_num_seqs=4)
    runner = llm.runner
    graphs = runner.prefill_graphs
    assert graphs is not None and graphs.sizes[-1] == 1024
    block = runner.block_size

    def both(inputs):  # (graph, eager) logits of the same step
        before = graphs.replays
        with torch.inference_mode():
            replayed = runner.compute_logits(runner.forward(inputs), inputs).float()
            runner.prefill_graphs = None
            eager = runner.compute_logits(runner.forward(inputs), inputs).float()
            runner.prefill_graphs = graphs
        assert graphs.replays == before + 1
        return replayed, eager

    cases = []
    for prompt in _prompts(n=6, seed=5):
        cases.append(both(prefill_inputs([prompt], block, -(-len(prompt) // block))))
        if len(prompt) > block + 1:  # the tokens past the first block, over the first block in the cache
            whole = prefill_inputs([prompt], block, -(-len(prompt) // block))
            n = len(prompt) - block
            tail = StepInputs(whole.input_ids[block:], whole.positions[block:], whole.slot_mapping[block:],
                              torch.tensor([0, n], dtype=torch.int32), whole.seqlens_k, whole.block_tables,
                              n, len(prompt), torch.tensor([n - 1]))
            cases.append(both(tail))
    errors = [float((g - e).norm() / e.norm()) for g, e in cases]
    same = sum(int(g.argmax() == e.argmax()) for g, e in cases)
    print("prefill graph against eager, relative error:", errors)
    assert len(cases) >= 8 and max(errors) < 1e-2 and same >= len(cases) - 1
    before = graphs.replays
    outs = [llm.generate(p, SamplingParams(temperature=0, max_tokens=MAX_NEW), use_tqdm=False)[0]
            for p in _prompts(n=2, seed=6)]
    assert graphs.replays == before + 2 and all(len(o.token_ids) == MAX_NEW for o in outs)


def test_shutdown_hands_the_gpu_memory_back_without_a_collection(gpu_checkpoint, free_gpu):
    gc.collect()
    torch.cuda.empty_cache()
    baseline, reserved_before = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    llm = LLM(str(gpu_checkpoint), device="cuda", dtype="bfloat16", gpu_memory_utilization=0.3)
    assert llm.runner.graphs is not None  # CUDA graphs captured: the runner and its graphs refer to each other
    llm.generate(_prompts(n=4), SamplingParams(temperature=0.8, max_tokens=MAX_NEW), use_tqdm=False)
    built = torch.cuda.memory_allocated()
    gc.disable()  # what shutdown frees must not wait for a collection
    try:
        llm.shutdown()
        after, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    finally:
        gc.enable()
    print(f"allocated {baseline >> 20} MiB before, {built >> 20} built, {after >> 20} after shutdown; "
          f"{reserved >> 20} reserved")
    # what stays is the BLAS handles' workspaces and the kernels' small scratch, not the GBs of cache and weights
    assert built - baseline > 4 << 30 and after - baseline < 512 << 20 and reserved - reserved_before < 1 << 30
    second = LLM(str(gpu_checkpoint), device="cuda", dtype="bfloat16", gpu_memory_utilization=0.3)
    assert len(second.generate([[5, 6, 7]], SamplingParams(max_tokens=4), use_tqdm=False)[0].token_ids) == 4
    second.shutdown()


def assert_greedy_agrees_but_at_near_ties(hf_model, prompts, outs, max_new_tokens: int, judge=None) -> None:
    """bf16 greedy tokens against transformers' on the same weights: at least a third of the sequences equal,
    and every divergence at a near-tie (the two tokens' logits within 0.1 of the logits' std, by `judge`'s
    logits on the shared prefix: transformers in fp32 where given, else hf_model's own)."""
    judge = judge or hf_model
    same, gaps = 0, []
    with torch.inference_mode():
        for p, o in zip(prompts, outs):
            ids = torch.tensor([p], device="cuda")
            ref = hf_model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                    max_new_tokens=max_new_tokens, eos_token_id=2, pad_token_id=0)[0, len(p):].tolist()
            if ref == o.token_ids:
                same += 1
                continue
            at = next(i for i, (a, b) in enumerate(zip(ref, o.token_ids)) if a != b)
            logits = judge(torch.tensor([p + ref[:at]], device="cuda")).logits[0, -1].float()
            gaps.append(float((logits[ref[at]] - logits[o.token_ids[at]]) / logits.std()))
    print(f"{same}/{len(prompts)} equal; divergence gaps in logit std: {sorted(gaps)}")
    assert same >= len(prompts) // 3
    assert all(g < 0.1 for g in gaps), f"a divergence that is no near-tie: gaps {sorted(gaps)}"


def assert_greedy_as_close_to_fp32_as_transformers_bf16(hf_bf16, hf_fp32, prompts, outs, max_new_tokens: int) -> None:
    """bf16 greedy tokens of a mixture of experts against transformers' fp32 ones. A bf16 rounding that sends a
    token to another expert moves its hidden state by far more than a near-tie of the logits, so transformers'
    own bf16 run parts from its fp32 run too, at gaps no near-tie rule allows. Ours must keep at least 80% of
    the leading tokens (summed over the prompts) that transformers' bf16 run keeps in common with fp32."""
    def generate(model, p):
        ids = torch.tensor([p], device="cuda")
        return model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new_tokens,
                              eos_token_id=2, pad_token_id=0)[0, len(p):].tolist()

    def leading(a, b):
        return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))

    ours = theirs = 0
    with torch.inference_mode():
        for p, o in zip(prompts, outs):
            ref32 = generate(hf_fp32, p)
            ours += leading(o.token_ids, ref32)
            theirs += leading(generate(hf_bf16, p), ref32)
    print(f"leading tokens in common with transformers fp32: ours {ours}, transformers bf16 {theirs}")
    assert ours >= 0.8 * theirs, (ours, theirs)
