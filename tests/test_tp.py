"""Tensor parallelism on CPU (gloo): TP=2 gives TP=1's tokens, and a failed rank stops the engine cleanly."""
from __future__ import annotations

import json
import os
import random
import signal
import time
from pathlib import Path

import psutil
import pytest
import torch

from engine import LLM, SamplingParams
from engine.execution.distributed import RankFailedError
from tests.conftest import make_checkpoint

MAX_NEW = 20
# a KV cache this small preempts sequences; the repeated prompts hit the prefix cache
TIGHT_CACHE = dict(device="cpu", kvcache_block_size=4, num_kvcache_blocks=40, max_model_len=128,
                   max_num_batched_tokens=32, enable_prefix_caching=True)


def tp_prompts(seed: int = 1) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(3, 500) for _ in range(24)]
    fresh = [[rng.randrange(3, 500) for _ in range(rng.randint(1, 50))] for _ in range(12)]
    shared = [prefix + [rng.randrange(3, 500) for _ in range(rng.randint(1, 12))] for _ in range(4)]
    return fresh + shared + shared[:2]


def _spawned_children() -> list[int]:
    pids = []
    for p in psutil.Process().children(recursive=True):
        try:
            if any("spawn_main" in part for part in p.cmdline()):
                pids.append(p.pid)
        except psutil.Error:  # exited while we looked
            pass
    return pids


def assert_ranks_gone(pids: list[int]) -> None:
    assert not [pid for pid in pids if psutil.pid_exists(pid)]
    assert _spawned_children() == []


def generate_ids(llm: LLM, prompts, params) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def _run_on_two_gpus(script: str, checkpoint, mode: str, timeout: float, prompts=None) -> dict:
    """Run `script` (argv: checkpoint, prompts as JSON, tp_all_reduce) in a fresh process with tp_all_reduce
    `mode`; its last stdout line, as JSON. GPU engines run in processes of their own (see
    docs/tensor-parallel.md)."""
    import subprocess
    import sys

    env = dict(os.environ, NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1")
    proc = subprocess.run([sys.executable, "-c", script, str(checkpoint), json.dumps(prompts or tp_prompts()), mode],
                          capture_output=True, text=True, env=env, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_tp_size_must_divide_attention_and_kv_heads(qwen3_checkpoint):
    with pytest.raises(ValueError, match=r"num_attention_heads \(4\) must be divisible by tensor_parallel_size \(3\)"):
        LLM(str(qwen3_checkpoint), device="cpu", tensor_parallel_size=3)
    with pytest.raises(ValueError, match=r"num_key_value_heads \(2\) must be divisible by tensor_parallel_size \(4\)"):
        LLM(str(qwen3_checkpoint), device="cpu", tensor_parallel_size=4)


@pytest.mark.timeout(300)
def test_tp2_tokens_equal_tp1_with_prefix_cache_and_preemption(checkpoint):
    prompts = tp_prompts()
    greedy = SamplingParams(temperature=0, max_tokens=MAX_NEW)
    seeded = [SamplingParams(temperature=0.8, top_p=0.9, seed=i, max_tokens=8, logprobs=2) for i in range(len(prompts))]
    tp1 = LLM(str(checkpoint), **TIGHT_CACHE)
    expected_greedy = generate_ids(tp1, prompts, greedy)
    expected_seeded = tp1.generate(prompts, seeded, use_tqdm=False)

    llm = LLM(str(checkpoint), tensor_parallel_size=2, **TIGHT_CACHE)
    pids = llm.runner.worker_pids
    try:
        assert llm.block_manager.num_blocks == 40
        assert generate_ids(llm, prompts, greedy) == expected_greedy
        assert llm.scheduler.num_preemptions > 0
        assert llm.block_manager.num_cache_hits > 0
        assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks
        got_seeded = llm.generate(prompts, seeded, use_tqdm=False)
        assert [o.token_ids for o in got_seeded] == [o.token_ids for o in expected_seeded]
        for got, want in zip(got_seeded, expected_seeded):
            want_logprobs = [lp["logprob"] for lp in want.logprobs]
            assert [lp["logprob"] for lp in got.logprobs] == pytest.approx(want_logprobs, abs=1e-4)
    finally:
        llm.shutdown()
    assert_ranks_gone(pids)


@pytest.mark.timeout(300)
def test_tp2_async_scheduling_tokens_equal_tp1_with_prefix_cache_and_preemption(checkpoint, tmp_path):
    prompts = tp_prompts(seed=2)
    greedy = SamplingParams(temperature=0, max_tokens=MAX_NEW)
    seeded = [SamplingParams(temperature=0.8, top_p=0.9, seed=i, max_tokens=8) for i in range(len(prompts))]
    # structured output: rank 0 samples the gathered logits under the masks, constrained rows beside free ones
    constrained = [SamplingParams(temperature=0, max_tokens=MAX_NEW, regex=r"[a-z]{2,5}(, [a-z]{2,5})*\.")
                   if i % 3 == 0 else SamplingParams(seed=i, max_tokens=8, choice=["yes", "no"]) if i % 3 == 1
                   else seeded[i] for i in range(len(prompts))]
    tp1 = LLM(str(checkpoint), **TIGHT_CACHE)
    expected_greedy = generate_ids(tp1, prompts, greedy)
    expected_seeded = generate_ids(tp1, prompts, seeded)
    expected_constrained = generate_ids(tp1, prompts, constrained)

    llm = LLM(str(checkpoint), tensor_parallel_size=2, async_scheduling=True, **TIGHT_CACHE)
    pids = llm.runner.worker_pids
    try:
        assert llm.async_scheduling
        # rank 1 traces its device over this generate (a measurement hook that must not disturb the steps)
        llm.runner.trace_ranks(str(tmp_path / "trace_rank{rank}.json"))
        assert generate_ids(llm, prompts, greedy) == expected_greedy
        llm.runner.trace_ranks(None)
        assert llm.scheduler.num_preemptions > 0
        assert llm.block_manager.num_cache_hits > 0
        assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks
        assert generate_ids(llm, prompts, seeded) == expected_seeded  # acknowledged after rank 1 wrote the trace
        assert generate_ids(llm, prompts, constrained) == expected_constrained
        assert json.loads((tmp_path / "trace_rank1.json").read_text())["traceEvents"]
    finally:
        llm.shutdown()
    assert_ranks_gone(pids)


@pytest.mark.timeout(120)
def test_killed_rank_with_async_scheduling_makes_generate_raise_and_leaves_no_process(qwen3_checkpoint):
    llm = LLM(str(qwen3_checkpoint), device="cpu", tensor_parallel_size=2, kvcache_block_size=8,
              async_scheduling=True)
    start = time.monotonic()
    pids = llm.runner.worker_pids
    steps = 0
    launch = llm.runner.execute_model

    def launch_then_kill(*args, **kwargs):
        nonlocal steps
        steps += 1
        if steps == 4:
            os.kill(pids[0], signal.SIGKILL)
        return launch(*args, **kwargs)

    llm.runner.execute_model = launch_then_kill
    with pytest.raises(RankFailedError, match=r"rank 1 \(pid \d+\) was killed by signal SIGKILL"):
        generate_ids(llm, tp_prompts(), SamplingParams(temperature=0, max_tokens=MAX_NEW))
    assert steps <= 5
    assert time.monotonic() - start < 30  # the failure is noticed within seconds, never as a hang
    assert_ranks_gone(pids)
    with pytest.raises(RuntimeError, match="stopped earlier"):
        generate_ids(llm, tp_prompts()[:1], SamplingParams(temperature=0, max_tokens=2))
    llm.shutdown()


@pytest.mark.timeout(120)
def test_killed_rank_makes_generate_raise_and_leaves_no_process(qwen3_checkpoint):
    llm = LLM(str(qwen3_checkpoint), device="cpu", tensor_parallel_size=2, kvcache_block_size=8)
    pids = llm.runner.worker_pids
    steps = 0
    launch = llm.runner.execute_model

    def launch_then_kill(*args, **kwargs):
        nonlocal steps
        steps += 1
        if steps == 4:
            os.kill(pids[0], signal.SIGKILL)
        return launch(*args, **kwargs)

    llm.runner.execute_model = launch_then_kill
    with pytest.raises(RankFailedError, match=r"rank 1 \(pid \d+\) was killed by signal SIGKILL"):
        generate_ids(llm, tp_prompts(), SamplingParams(temperature=0, max_tokens=MAX_NEW))
    assert steps == 4
    assert_ranks_gone(pids)
    with pytest.raises(RuntimeError, match="stopped earlier"):
        generate_ids(llm, tp_prompts()[:1], SamplingParams(temperature=0, max_tokens=2))
    llm.shutdown()


@pytest.mark.timeout(120)
def test_rank_that_raises_stops_the_engine_with_its_traceback(qwen3_checkpoint):
    llm = LLM(str(qwen3_checkpoint), device="cpu", tensor_parallel_size=2, kvcache_block_size=8)
    pids = llm.runner.worker_pids
    assert generate_ids(llm, tp_prompts()[:2], SamplingParams(temperature=0, max_tokens=4))
    workers = llm.runner._workers
    workers.send(("execute", {"not": "step inputs"}, False))  # rank 1 fails to build its step
    with pytest.raises(RankFailedError, match=r"rank 1 \(pid \d+\) raised an error") as failure:
        workers.collect("ok")
    assert "TypeError" in str(failure.value) and "rank 1 traceback" in str(failure.value)
    assert_ranks_gone(pids)
    llm.shutdown()


@pytest.mark.timeout(120)
def test_startup_error_is_raised_as_is_and_leaves_no_process(qwen3_checkpoint):
    with pytest.raises(ValueError, match="the KV cache holds 2 blocks"):
        LLM(str(qwen3_checkpoint), device="cpu", tensor_parallel_size=2, kvcache_block_size=4,
            num_kvcache_blocks=2, max_model_len=64)
    assert _spawned_children() == []


@pytest.mark.timeout(120)
def test_engine_after_a_failed_one_starts_and_matches_tp1(qwen3_checkpoint):
    prompts = tp_prompts()[:4]
    greedy = SamplingParams(temperature=0, max_tokens=8)
    expected = generate_ids(LLM(str(qwen3_checkpoint), device="cpu"), prompts, greedy)
    llm = LLM(str(qwen3_checkpoint), device="cpu", tensor_parallel_size=2)
    try:
        assert generate_ids(llm, prompts, greedy) == expected
    finally:
        llm.shutdown()


_TP2_GPU_TOKENS = """
import json, sys
from engine import LLM, SamplingParams
llm = LLM(sys.argv[1], tensor_parallel_size=2, max_model_len=256, gpu_memory_utilization=0.3,
          tp_all_reduce=sys.argv[3])
tp = llm.runner.runner.tp
outs = llm.generate(json.loads(sys.argv[2]), SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
print(json.dumps({"one_shot": tp.one_shot is not None, "pushed_calls": tp.pushed.calls if tp.pushed else 0,
                  "tokens": [o.token_ids for o in outs]}))
llm.shutdown()
"""


@pytest.mark.gpu
@pytest.mark.timeout(600)
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                    reason="needs 2 GPUs")
def test_symmetric_memory_all_reduce_gives_nccl_tokens_on_two_gpus(qwen3_checkpoint):
    """Both sum the two ranks' parts in rank order, so the tokens must agree exactly (CUDA graphs on)."""
    runs = {mode: _run_on_two_gpus(_TP2_GPU_TOKENS, qwen3_checkpoint, mode, timeout=500) for mode in ("engine", "nccl")}
    assert runs["engine"]["one_shot"] and not runs["nccl"]["one_shot"]
    assert runs["engine"]["tokens"] == runs["nccl"]["tokens"]


@pytest.mark.gpu
@pytest.mark.timeout(600)
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                    reason="needs 2 GPUs")
def test_copy_engine_all_reduce_gives_nccl_tokens_on_two_gpus(tmp_path):
    """A prefill step of 2,400 rows at hidden 4096 all-reduces more than the one-shot kernel's 8 MiB: its
    row-parallel projections are summed by the copy engines (CopyEngineSum, chunks of rows, flags, the fused
    receiving kernel) and give NCCL's tokens, both summing in rank order."""
    wide = make_checkpoint("qwen3", tmp_path / "wide", hidden_size=4096)
    rng = random.Random(4)
    prompts = [[rng.randrange(3, 500) for _ in range(200)] for _ in range(12)]
    runs = {mode: _run_on_two_gpus(_TP2_GPU_TOKENS, wide, mode, timeout=500, prompts=prompts)
            for mode in ("engine", "nccl")}
    assert runs["engine"]["pushed_calls"] > 0 and runs["nccl"]["pushed_calls"] == 0
    assert runs["engine"]["tokens"] == runs["nccl"]["tokens"]


_TP2_GPU_KILL = """
import json, os, signal, sys, time
import psutil
from engine import LLM, SamplingParams
from engine.execution.distributed import RankFailedError
from tests.conftest import make_checkpoint
llm = LLM(sys.argv[1], tensor_parallel_size=2, max_model_len=256, gpu_memory_utilization=0.3,
          tp_all_reduce=sys.argv[3])
pid, steps, launch, killed = llm.runner.worker_pids[0], [0], llm.runner.execute_model, []
def launch_then_kill(*args, **kwargs):
    steps[0] += 1
    if steps[0] == 20:  # decode steps replay CUDA graphs by now
        killed.append(time.monotonic())
        os.kill(pid, signal.SIGKILL)
    return launch(*args, **kwargs)
llm.runner.execute_model = launch_then_kill
result = {}
try:
    llm.generate(json.loads(sys.argv[2]), SamplingParams(temperature=0, max_tokens=200, ignore_eos=True), use_tqdm=False)
except RankFailedError as e:
    result.update(raised=str(e).splitlines()[0], seconds=time.monotonic() - killed[0])
result["children"] = [p.pid for p in psutil.Process().children(recursive=True) if p.is_running()
                      and any("spawn_main" in part for part in p.cmdline())]
llm.shutdown()
del llm, launch  # the failed engine's GPU memory goes with it (the saved bound method held the engine too)
import gc, torch
gc.collect()
torch.cuda.empty_cache()
fresh = LLM(sys.argv[1], tensor_parallel_size=2, max_model_len=256, gpu_memory_utilization=0.3,
            tp_all_reduce=sys.argv[3])
outs = fresh.generate(json.loads(sys.argv[2])[:2], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
result["fresh_tokens"] = sum(len(o.token_ids) for o in outs)
fresh.shutdown()  # a normal shutdown releases the group too: one more engine in this process
del fresh, outs
gc.collect()
torch.cuda.empty_cache()
third = LLM(sys.argv[1], tensor_parallel_size=2, max_model_len=256, gpu_memory_utilization=0.3,
            tp_all_reduce=sys.argv[3])
outs = third.generate(json.loads(sys.argv[2])[:2], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
result["third_tokens"] = sum(len(o.token_ids) for o in outs)
third.shutdown()
print(json.dumps(result))
"""


@pytest.mark.gpu
@pytest.mark.timeout(400)
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                    reason="needs 2 GPUs")
@pytest.mark.parametrize("mode", ["nccl", "engine"])
def test_killed_rank_on_gpus_makes_generate_raise_and_a_fresh_engine_start(qwen3_checkpoint, mode):
    """NCCL and the symmetric-memory kernels wait forever on a dead peer: rank 0 must still raise within
    seconds (CUDA graphs on), end the other rank, release its communicator, and the same process must be
    able to start a new engine (and, after that one's normal shutdown, another; with "engine" these use NCCL,
    see docs/tensor-parallel.md)."""
    result = _run_on_two_gpus(_TP2_GPU_KILL, qwen3_checkpoint, mode, timeout=360)
    assert "rank 1" in result.get("raised", "") and "SIGKILL" in result["raised"], result
    assert result["seconds"] < 30, result  # within seconds, never a hang (the backstops are 300 s)
    assert result["children"] == []
    assert result["fresh_tokens"] == 8 and result["third_tokens"] == 8


_SECOND_GROUP_SAME_NAME = """
import json, sys, warnings
import torch, torch.distributed as dist
import torch.distributed._symmetric_memory as symm_mem
from engine.layers.parallel import OneShotAllReduce
folder = sys.argv[1]
dist.init_process_group("gloo", init_method=f"file://{folder}/first", rank=0, world_size=1)
name = dist.group.WORLD.group_name
with warnings.catch_warnings():
    warnings.simplefilter("ignore", FutureWarning)
    symm_mem.enable_symm_mem_for_group(name)  # what the first engine of this process did
dist.destroy_process_group()
dist.init_process_group("gloo", init_method=f"file://{folder}/second", rank=0, world_size=1)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    made = OneShotAllReduce.create(torch.device("cpu"), torch.bfloat16, 0, 1)
print(json.dumps({"same_name": dist.group.WORLD.group_name == name, "made": made is not None,
                  "warnings": [str(w.message) for w in caught]}))
"""


def test_second_engine_in_a_process_skips_symmetric_memory_bound_to_the_first_ones_store(tmp_path):
    """PyTorch binds a group name to its first store for the process's life and names every new default
    group "0": a second engine's rendezvous would wait on the first engine's store, so it must use NCCL."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", _SECOND_GROUP_SAME_NAME, str(tmp_path)], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["same_name"]  # the premise: the new default group reuses the name
    assert not result["made"]
    assert any("earlier tensor-parallel engine" in w for w in result["warnings"]), result["warnings"]


_TWO_RANKS_ONE_BOUND = """
import warnings
import torch, torch.distributed as dist


def rank_main(rank, folder, queue):
    import torch.distributed._symmetric_memory as symm_mem
    from engine.layers.parallel import OneShotAllReduce
    if rank == 0:  # rank 0's process ran an engine before; a new engine's other ranks are new processes
        dist.init_process_group("gloo", init_method=f"file://{folder}/first", rank=0, world_size=1)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            symm_mem.enable_symm_mem_for_group(dist.group.WORLD.group_name)
        dist.destroy_process_group()
    dist.init_process_group("gloo", init_method=f"file://{folder}/second", rank=rank, world_size=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        made = OneShotAllReduce.create(torch.device("cpu"), torch.bfloat16, rank, 2)
    queue.put([rank, made is not None, [str(w.message) for w in caught]])
    dist.destroy_process_group()

"""

# the end of a two-rank script: rank_main(rank, folder, queue) in two spawned processes, each putting one
# [rank, ...] result; prints {"hung": pids still running after 90 s, "ranks": the results in rank order}
_TWO_RANKS_MAIN = """

if __name__ == "__main__":
    import json, sys
    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(r, sys.argv[1], queue)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(90)
    hung = [p.pid for p in procs if p.is_alive()]
    for p in procs:
        p.kill()
    results = sorted(queue.get(timeout=5) for _ in range(2 - len(hung))) if not hung else []
    print(json.dumps({"hung": hung, "ranks": results}))
"""


def run_two_ranks(rank_main_source: str, folder: Path) -> dict:
    """Run rank_main_source + _TWO_RANKS_MAIN as a script in `folder` (its argument); its JSON result."""
    import subprocess
    import sys

    script = folder / "two_ranks.py"
    script.write_text(rank_main_source + _TWO_RANKS_MAIN)
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    proc = subprocess.run([sys.executable, str(script), str(folder)], capture_output=True, text=True,
                          timeout=180, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_ranks_agree_to_skip_symmetric_memory_when_one_of_them_cannot_use_it(tmp_path):
    """A second engine's rank 0 lives in a process whose group name is bound to an earlier store, while
    its other ranks are new processes: every rank must skip symmetric memory (a rank that entered the
    rendezvous alone would wait in it forever), and the fresh rank must say why."""
    result = run_two_ranks(_TWO_RANKS_ONE_BOUND, tmp_path)
    assert result["hung"] == [] and len(result["ranks"]) == 2, result
    (rank0, made0, warned0), (rank1, made1, warned1) = result["ranks"]
    assert not made0 and not made1
    assert any("earlier tensor-parallel engine" in w for w in warned0), warned0
    assert any("another tensor-parallel rank cannot use symmetric memory" in w for w in warned1), warned1


def test_unknown_tp_all_reduce_mode_is_a_clear_error(qwen3_checkpoint):
    with pytest.raises(ValueError, match="tp_all_reduce must be one of engine, nccl, got 'fast'"):
        LLM(str(qwen3_checkpoint), device="cpu", tensor_parallel_size=2, tp_all_reduce="fast")
    assert _spawned_children() == []


@pytest.mark.gpu
@pytest.mark.timeout(600)
@pytest.mark.parametrize("model,sizes", [("qwen3-8b", (1, 2)), ("qwen3-32b", (2, 4))])
def test_tp_sizes_agree_on_large_shapes_up_to_near_ties(model, sizes, tmp_path):
    """bench/tp_check.py's greedy check on the shipped shapes (dummy weights, CUDA graphs and async scheduling
    on): the chosen tokens' logprobs agree between the two sizes to bf16's tolerance, and wherever a sequence
    parts, the smaller size's own margin between the two tokens is within that tolerance (a near-tie: random
    weights give flat distributions, so sequences part early, each at such a tie)."""
    import subprocess
    import sys

    if not torch.cuda.is_available() or torch.cuda.device_count() < max(sizes):
        pytest.skip(f"needs {max(sizes)} GPUs")
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
    script = Path(__file__).resolve().parents[1] / "bench" / "tp_check.py"
    proc = subprocess.run([sys.executable, str(script), "--model", model, "--sizes", ",".join(map(str, sizes)),
                           "--skip-bench", "--skip-failure-check", "--num-prompts", "16", "--max-new", "32",
                           "--out", str(tmp_path)], capture_output=True, text=True, env=env, timeout=560)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    greedy = json.loads(proc.stdout.strip().splitlines()[-1])["greedy"]
    tolerance = greedy["max_logprob_diff_before_divergence"]
    assert tolerance < 0.5, greedy  # bf16 through 36 or 64 layers summed in another order
    assert None not in greedy["divergence_logprob_gaps"], greedy  # each parting token was in the top 5
    assert all(gap <= 2 * tolerance + 0.05 for gap in greedy["divergence_logprob_gaps"]), greedy
    assert _spawned_children() == []
