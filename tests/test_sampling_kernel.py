"""The Gumbel-max sampling kernel (engine/kernels/sampling.py): greedy rows, the token distribution,
seeds, tokens that do not depend on how a row is split, and the logprobs taken with them.

On CPU the cases of tests/sampling_cases.py run under the Triton interpreter in a subprocess
(TRITON_INTERPRET must be set before triton is imported); the CUDA versions are marked `gpu`.
"""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from interpreter import run_under_interpreter  # noqa: E402
from sampling_cases import (  # noqa: E402
    FUSED_GPU_LAYOUTS,
    GPU_LAYOUTS,
    distribution_case,
    fused_logprobs_case,
    greedy_case,
    layout_case,
    seed_case,
    token_logprobs_case,
)

HAS_TRITON = importlib.util.find_spec("triton") is not None
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
# 600 draws per temperature: sampling error alone stays under 0.105 in 99.99% of runs
MAX_TV = 0.11


@pytest.fixture(scope="module")
def interpreted() -> dict:
    """Every CPU case, run once under the interpreter in a fresh interpreter process."""
    return run_under_interpreter(Path(__file__).parent / "sampling_cases.py")


def total_variation(p: list[float], q: list[float]) -> float:
    return 0.5 * sum(abs(a - b) for a, b in zip(p, q))


def assert_greedy_rows_are_argmax(case: dict, vocab: int) -> None:
    for layout, tokens in case["layouts"].items():
        for i in case["greedy_rows"]:
            assert tokens[i] == case["argmax"][i], f"layout {layout}, row {i}: {tokens[i]}, not {case['argmax'][i]}"
        assert all(0 <= t < vocab for t in tokens), f"layout {layout}: token outside the vocabulary in {tokens}"


def assert_distribution_matches_softmax(case: dict, max_tv: float) -> None:
    for t, counts, expected in zip(case["temperatures"], case["counts"], case["expected"]):
        empirical = [c / sum(counts) for c in counts]
        tv = total_variation(empirical, expected)
        assert tv < max_tv, f"t={t}: counts {counts} are {tv:.3f} (total variation) off softmax(logits / t)"


@needs_triton
def test_greedy_rows_equal_torch_argmax_among_sampled_rows_under_interpreter(interpreted):
    assert_greedy_rows_are_argmax(interpreted["greedy"], 37)
    assert_greedy_rows_are_argmax(interpreted["greedy_fp32"], 37)


@needs_triton
def test_pending_rows_take_the_device_token_under_interpreter(interpreted):
    case = interpreted["take_pending"]
    assert case["sizes"] == [1, 7, 300, 1500] and case["mismatches"] == 0, case


@needs_triton
def test_tokens_follow_softmax_of_logits_over_temperature_under_interpreter(interpreted):
    case = interpreted["distribution"]
    assert_distribution_matches_softmax(case, MAX_TV)
    # the bound catches broken kernels: each of these is off by more than MAX_TV + 0.1 at some temperature
    logits = torch.tensor(case["logits"])
    vocab = len(logits)
    broken = {
        "temperature ignored": [logits.softmax(-1)] * 2,
        "temperature inverted": [(logits * t).softmax(-1) for t in case["temperatures"]],
        "row temperatures swapped": [(logits / t).softmax(-1) for t in reversed(case["temperatures"])],
        "uniform": [torch.full((vocab,), 1 / vocab)] * 2,
        "no noise": [torch.nn.functional.one_hot(logits.argmax(), vocab).float()] * 2,
    }
    for name, dists in broken.items():
        worst = max(total_variation(d.tolist(), e) for d, e in zip(dists, case["expected"]))
        assert worst > MAX_TV + 0.1, name


@needs_triton
def test_same_seed_gives_same_tokens_and_another_seed_other_tokens_under_interpreter(interpreted):
    seeds = interpreted["seeds"]
    assert seeds["first"] == seeds["again"] == seeds["in_memory"]
    assert sum(a != b for a, b in zip(seeds["first"], seeds["other"])) >= len(seeds["first"]) // 2
    assert len(set(seeds["first"])) >= 10, "identical rows drew near-identical tokens: the row must enter the noise"


@needs_triton
def test_tokens_do_not_depend_on_split_count_or_tile_under_interpreter(interpreted):
    layouts = interpreted["layouts"]
    first = next(iter(layouts.values()))
    assert len(set(first)) > 3
    for layout, tokens in layouts.items():
        assert tokens == first, f"layout {layout} (num_splits, block) gave {tokens}, not {first}"


@pytest.mark.gpu
@needs_cuda
def test_greedy_rows_equal_torch_argmax_on_gpu():
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        assert_greedy_rows_are_argmax(greedy_case("cuda", 151936, GPU_LAYOUTS, dtype), 151936)
    assert_greedy_rows_are_argmax(greedy_case("cuda", 37, [(3, 16), (None, None)]), 37)


@pytest.mark.gpu
@needs_cuda
def test_tokens_follow_softmax_of_logits_over_temperature_on_gpu():
    case = distribution_case("cuda", seeds=list(range(20)), rows_per_temperature=5000)
    assert_distribution_matches_softmax(case, 0.02)  # 100k draws per temperature


@pytest.mark.gpu
@needs_cuda
def test_tokens_do_not_depend_on_split_count_or_tile_on_gpu():
    layouts = layout_case("cuda", 151936, GPU_LAYOUTS, num_rows=64)
    first = next(iter(layouts.values()))
    assert all(tokens == first for tokens in layouts.values()), layouts
    seeds = seed_case("cuda", vocab=151936, num_rows=64, layout=(None, None))
    assert seeds["first"] == seeds["again"] == seeds["in_memory"] and seeds["first"] != seeds["other"]


@pytest.mark.gpu
@needs_cuda
def test_sample_on_cuda_seeds_the_kernel_from_the_host_generator():
    from engine.kernels.sampling import gumbel_argmax
    from engine.sampling.sampler import SamplingTensors, sample

    rows, vocab = 16, 1000
    logits = torch.randn(rows, vocab, device="cuda")
    st = SamplingTensors(temperatures=torch.ones(rows, device="cuda"),
                         top_ks=torch.full((rows,), vocab, device="cuda"), top_ps=torch.ones(rows, device="cuda"),
                         min_ps=torch.zeros(rows, device="cuda"), generators=[None] * rows,
                         all_greedy=False, needs_filter=False)
    tokens = sample(logits, st, seed_gen=torch.Generator().manual_seed(5))
    seed = int(torch.randint(0, 2**31 - 1, (1,), generator=torch.Generator().manual_seed(5)))
    assert tokens.tolist() == gumbel_argmax(logits, st.temperatures, seed).tolist()
    assert tokens.tolist() == sample(logits, st, seed_gen=torch.Generator().manual_seed(5)).tolist()


@pytest.mark.gpu
@needs_cuda
def test_sampling_kernel_compiles_one_variant_for_every_seed():
    """The seed changes every step; a variant compiled for seeds divisible by 16 (Triton specialises
    integer arguments) would first compile inside a timed run."""
    from engine.kernels import sampling

    def variants() -> int:
        caches = getattr(sampling._gumbel_split_kernel, "device_caches", None)
        if caches is None:
            pytest.skip("this Triton does not expose its kernel caches")
        return sum(len(cache[0]) for cache in caches.values())

    logits = torch.randn(3, 1000, device="cuda")
    temperatures = torch.ones(3, device="cuda")
    sampling.gumbel_argmax(logits, temperatures, 17)
    before = variants()
    for seed in (1, 16, 32, 2**20, 12345):
        sampling.gumbel_argmax(logits, temperatures, seed)
    assert variants() == before


@needs_triton
@pytest.mark.parametrize("logprobs", [False, True], ids=["tokens", "with_logprobs"])
def test_sampling_kernel_computes_each_philox_draw_once_per_thread_when_compiled_for_hopper(logprobs):
    """Compiled for sm_90 on any machine (bench/kernel_ir.py: the wrapper's launch, specialised as on the
    GPU; with logprobs as the decode graph launches it), each group's Philox call is made by one thread
    and no draw moves between threads. The [GROUPS, 4] tile this replaced spread a group's four columns
    over four threads: Triton 3.6 had each of them compute the group's Philox call (305 32-bit high
    multiplies a loop against 77 now), Triton 3.9 converted the draws' layout instead (8 conversions); on
    the H100 (Triton 3.6) it was 3.5x slower at 256 rows."""
    from engine.kernels import sampling

    sys.path.insert(0, str(Path(__file__).parent.parent / "bench"))
    import kernel_ir

    kernel, args, kwargs = kernel_ir.capture(kernel_ir.case_sampling(256, logprobs))
    assert kernel is sampling._gumbel_split_kernel
    try:
        compiled = kernel_ir.compile_for(kernel, args, kwargs, 90)
    except Exception as e:  # noqa: BLE001 - a Triton without the CUDA backend's tools, or another compile API
        pytest.skip(f"cannot compile for sm_90 here: {type(e).__name__}: {str(e)[:200]}")
    counts = kernel_ir.counts(compiled, 90)
    assert counts["layout_conversions"] == 0, counts
    assert counts["lg2"] > 0, counts  # the CUDA variant (fast logs), as the engine launches it
    # a Philox call is 10 rounds of two high multiplies; a thread makes groups / threads calls a tile
    once = 10 * 2 * (sampling.DEFAULT_BLOCK // 4) // (32 * compiled.metadata.num_warps)
    assert counts["mul_hi"] < 2 * once, (counts["mul_hi"], once)


@needs_triton
def test_token_logprobs_equal_torch_log_softmax_under_interpreter(interpreted):
    worst = interpreted["token_logprobs"]
    assert len(worst) == 12 and max(worst.values()) < 1e-4, worst


@pytest.mark.gpu
@needs_cuda
def test_token_logprobs_equal_torch_log_softmax_on_gpu():
    worst = token_logprobs_case("cuda", 151936, GPU_LAYOUTS)
    assert max(worst.values()) < 1e-3, worst  # fp32 sums over 150k columns in another order than torch's


def assert_fused_logprobs_match_log_softmax(case: dict, num_layouts: int, max_error: float) -> None:
    assert len(case["worst"]) == 2 * num_layouts, case["worst"]
    assert all(rows == [] for rows in case["token_changes"].values()), case["token_changes"]
    assert max(case["worst"].values()) < max_error, case["worst"]  # NaN (a row left unwritten) fails too
    assert len(set(case["sampled_tokens"])) >= 6, "rows sampled alike: the case would not tell tokens apart"


@needs_triton
def test_sampled_tokens_come_with_their_log_softmax_unchanged_under_interpreter(interpreted):
    assert_fused_logprobs_match_log_softmax(interpreted["fused_logprobs"], 6, 1e-5)


@pytest.mark.gpu
@needs_cuda
def test_sampled_tokens_come_with_their_log_softmax_unchanged_on_gpu():
    case = fused_logprobs_case("cuda", 151936, FUSED_GPU_LAYOUTS)
    assert_fused_logprobs_match_log_softmax(case, len(FUSED_GPU_LAYOUTS), 1e-4)
