"""Reproduces docs/performance.md's TP=2 / TP=1 figure on a 2-GPU machine (Qwen3-8B shape, dummy weights), with
TP=2 against TP=1 greedy agreement and the failed-rank check of docs/tensor-parallel.md.
    python3 bench/tp_check.py --out DIR           (--skip-bench, --skip-failure-check, worker.bench_engine's options)

One engine per tensor-parallel size, one after the other, each freed before the next. On each: greedy
completions of --num-prompts random prompts (ignore_eos, --max-new tokens), then worker.bench_engine's workload
timed after its warm-up. Prints one JSON line per bench run, then a JSON line with the throughput ratio
and the greedy agreement (bf16 TP sums in another order, so a few late divergences are expected).
Then the failure path on the small Qwen3 shape: rank 1 is killed mid-generation, generate must raise
within seconds with no process left, and a fresh engine must start after it (one more JSON line).
Each phase has a deadline; a phase that hangs is logged and ends the script with exit code 3.
Needs only torch, triton, transformers and the engine (no redis, no pydantic).
"""
from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import random
import signal
import sys
import threading
import time
import traceback
from contextlib import contextmanager
from pathlib import Path

# NVLink multicast stays off on shared hosts; spawned ranks inherit these
for _name, _value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                       ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(_name, _value)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

LOG = None
OUT_DIR = Path("out")


def dump_stacks(path: Path) -> None:
    """Every thread's Python stack, then every thread's native stack through cuda-gdb or gdb if present."""
    import faulthandler
    import shutil
    import subprocess

    with open(path, "w") as f:
        faulthandler.dump_traceback(file=f, all_threads=True)
    debugger = shutil.which("cuda-gdb") or shutil.which("gdb")
    if debugger is None:
        return
    with open(path, "a") as f:
        f.write(f"\n==== native stacks ({debugger})\n")
        f.flush()
        try:
            subprocess.run([debugger, "-p", str(os.getpid()), "-batch", "-ex", "thread apply all bt 40"],
                           stdout=f, stderr=subprocess.STDOUT, timeout=150)
        except subprocess.TimeoutExpired:
            f.write("debugger timed out\n")


def log(*parts) -> None:
    line = " ".join(str(p) for p in parts)
    print(line, flush=True)
    if LOG is not None:
        LOG.write(line + "\n")
        LOG.flush()


def parse_args(argv=None) -> argparse.Namespace:
    from worker import bench_engine as bench

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    bench.add_arguments(parser)
    parser.add_argument("--out", default="out", help="folder for tp_check.log and tp_check.json")
    parser.add_argument("--sizes", default="1,2", help="tensor-parallel sizes to run, in order")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--max-new", type=int, default=64)
    parser.add_argument("--skip-bench", action="store_true")
    parser.add_argument("--load-results", default=None,
                        help="folder of result_tp*.json from an earlier run (another process) to compare with")
    parser.add_argument("--skip-failure-check", action="store_true")
    parser.add_argument("--failure-model", default="qwen3-0.6b",
                        help="model of the failure check (config dir or shipped config name)")
    parser.set_defaults(model="qwen3-8b")
    args = parser.parse_args(argv)
    bench.check_arguments(args)  # prompt ids cut to the model's vocabulary, as the bench draws them
    return args


@contextmanager
def deadline(phase: str, seconds: float):
    """End the whole script (exit code 3) if `phase` takes longer than `seconds`: a hang is a finding, and
    the stacks of every thread (Python's, then native ones where a debugger is installed) say where."""
    def hung():
        log(f"HUNG: {phase} did not finish within {seconds:.0f} s; stacks in {OUT_DIR / 'stacks.txt'}")
        dump_stacks(OUT_DIR / "stacks.txt")
        if LOG is not None:
            LOG.flush()
        os._exit(3)

    timer = threading.Timer(seconds, hung)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def greedy_prompts(n: int, max_token_id: int, max_len: int, seed: int = 7) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randint(0, max_token_id) for _ in range(rng.randint(min(16, max_len), max_len))] for _ in range(n)]


def greedy_tokens(llm, prompts: list[list[int]], max_new: int) -> list[dict]:
    """Each prompt's greedy tokens with, per position, the chosen token's logprob and the top 5."""
    from engine import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_new, ignore_eos=True, logprobs=5)
    return [{"tokens": o.token_ids, "logprobs": [p["logprob"] for p in o.logprobs],
             "top": [{int(k): v for k, v in p["top"].items()} for p in o.logprobs]}
            for o in llm.generate(prompts, params, use_tqdm=False)]


def time_bench(llm, args: argparse.Namespace) -> dict:
    """worker.bench_engine's workload on an engine already built: warm up, time one generate, one record."""
    from worker import bench_engine as bench

    prompts, params = bench.make_workload(args)
    bench.warm_up(llm, args)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in outputs)
    gpu = bench.gpu_name()
    bandwidth = args.bandwidth or bench.default_bandwidth(gpu)
    config = llm.config
    floor = (bench.floor_seconds(config.hf_config, prompts, params, bandwidth, config.torch_dtype.itemsize,
                                 config.tensor_parallel_size) if bandwidth else None)
    commit = bench.git_commit(getattr(args, "commit", None))
    return {"gpu": gpu, "commit": commit, "date": time.strftime("%Y-%m-%d", time.gmtime()),
            "model": Path(bench.resolve_model(args.model)).name, "backend": llm.runner.ctx.backend.name,
            "tensor_parallel_size": config.tensor_parallel_size, "enforce_eager": args.enforce_eager,
            "num_seqs": args.num_seqs, "tokens": tokens, "expected_tokens": sum(p.max_tokens for p in params),
            "seconds": round(seconds, 3), "tok_s": round(tokens / seconds, 1),
            "floor_seconds": round(floor, 3) if floor else None,
            "ratio_to_floor": round(seconds / floor, 2) if floor else None}


def run_size(tp: int, args: argparse.Namespace, prompts) -> dict:
    import torch

    from worker import bench_engine as bench

    args.tensor_parallel_size = tp
    result: dict = {"tensor_parallel_size": tp}
    t0 = time.perf_counter()
    with deadline(f"TP={tp} engine start", 240):
        llm = bench.build_llm(args)
    try:
        result["build_seconds"] = round(time.perf_counter() - t0, 1)
        result["num_kvcache_blocks"] = llm.block_manager.num_blocks
        rank0 = getattr(llm.runner, "runner", llm.runner)  # TP>1: the TPDriver's own ModelRunner
        result["graph_batch_sizes"] = len(rank0.graphs.sizes) if rank0.graphs is not None else 0
        log(f"TP={tp}: engine built in {result['build_seconds']} s, {result['num_kvcache_blocks']} KV blocks, "
            f"backend {rank0.ctx.backend.name}, CUDA graphs for {result['graph_batch_sizes']} batch sizes")
        del rank0  # nothing here may keep the engine's graphs alive past its shutdown
        t0 = time.perf_counter()
        result["greedy"] = greedy_tokens(llm, prompts, args.max_new)
        log(f"TP={tp}: greedy check in {time.perf_counter() - t0:.1f} s")
        if not args.skip_bench:
            record = time_bench(llm, args)
            result["bench"] = record
            log(f"TP={tp}: {record['tokens']} tokens in {record['seconds']} s = {record['tok_s']:,.0f} tok/s")
            print(json.dumps(record), flush=True)
            if LOG is not None:
                LOG.write(json.dumps(record) + "\n")
    finally:
        t0 = time.perf_counter()
        with deadline(f"TP={tp} shutdown", 60):
            llm.shutdown()
            del llm
            gc.collect()
            torch.cuda.empty_cache()
        result["shutdown_seconds"] = round(time.perf_counter() - t0, 2)
        log(f"TP={tp}: shut down in {result['shutdown_seconds']} s")
    return result


def failure_check(args: argparse.Namespace) -> dict:
    """Kill rank 1 of a TP=2 engine (small shape, CUDA graphs on) mid-generation: generate must raise
    RankFailedError, no rank process may remain, and a fresh TP=2 engine must start and generate."""
    import torch

    from engine import LLM, SamplingParams
    from engine.execution.distributed import RankFailedError
    from worker import bench_engine as bench

    small = dict(load_format="dummy", tensor_parallel_size=2, max_num_seqs=64, max_model_len=4096,
                 gpu_memory_utilization=0.5, device=args.device)
    model = bench.resolve_model(args.failure_model)
    result: dict = {}
    with deadline("failure check: engine start", 180):
        llm = LLM(model, **small)
    pid = llm.runner.worker_pids[0]
    rng = random.Random(3)
    prompts = [[rng.randint(0, args.max_token_id) for _ in range(rng.randint(32, 256))] for _ in range(64)]
    params = SamplingParams(temperature=0, max_tokens=3000, ignore_eos=True)  # far longer than the 2 s to the kill
    killed_at = []

    def kill():
        killed_at.append(time.perf_counter())
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:  # the rank is gone already: the check below says so
            pass

    threading.Timer(2.0, kill).start()
    with deadline("failure check: generate after SIGKILL of rank 1", 45):
        try:
            llm.generate(prompts, params, use_tqdm=False)
            result["raised"] = None
        except RankFailedError as e:
            result["raised"] = str(e).splitlines()[0]
            result["seconds_to_error"] = round(time.perf_counter() - killed_at[0], 2) if killed_at else None
    try:
        import psutil
        result["children_left"] = [p.pid for p in psutil.Process().children(recursive=True)
                                   if "spawn_main" in " ".join(p.cmdline())]
    except ImportError:
        result["children_left"] = "psutil missing"
    import torch.distributed as dist
    result["process_group_released"] = not dist.is_initialized()
    with deadline("failure check: drop the failed engine", 60):
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    with deadline("failure check: a fresh engine after the failure", 180):
        fresh = LLM(model, enforce_eager=True, **small)
        outs = fresh.generate(prompts[:4], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
        result["fresh_engine_tokens"] = sum(len(o.token_ids) for o in outs)
        fresh.shutdown()
    result["ok"] = bool(result.get("raised") and result.get("children_left") == [] and result["process_group_released"]
                        and result["fresh_engine_tokens"] == 32)
    return result


def compare(reference: list[dict], other: list[dict]) -> dict:
    """Greedy agreement of two sizes. Where a sequence parts, the gap is the reference's own logprob margin
    between its token and the other's (None: the other's token is not in the reference's top 5): a near-tie
    parts bf16 runs that sum in another order. Before that, the chosen tokens' logprobs must agree to bf16's
    tolerance: the largest difference over the shared positions is reported."""
    firsts, gaps, max_diff = [], [], 0.0
    for a, b in zip(reference, other):
        ta, tb = a["tokens"], b["tokens"]
        first = next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), None)
        if first is None and len(ta) != len(tb):
            first = min(len(ta), len(tb))
        firsts.append(first)
        shared = len(ta) if first is None else first
        max_diff = max([max_diff] + [abs(x - y) for x, y in zip(a["logprobs"][:shared], b["logprobs"][:shared])])
        if first is not None and first < min(len(ta), len(tb)):
            theirs = a["top"][first].get(tb[first])
            gaps.append(None if theirs is None else round(a["logprobs"][first] - theirs, 4))
    diverged = sorted(f for f in firsts if f is not None)
    return {"identical_fraction": round(sum(f is None for f in firsts) / len(firsts), 3),
            "first_divergence_positions": diverged, "divergence_logprob_gaps": gaps,
            "max_logprob_diff_before_divergence": round(max_diff, 4)}


def main(argv=None) -> int:
    global LOG, OUT_DIR
    args = parse_args(argv)
    out = OUT_DIR = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    LOG = open(out / "tp_check.log", "a")
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s",
                        handlers=[logging.StreamHandler(), logging.FileHandler(out / "tp_check.log")])
    import torch

    log(f"torch {torch.__version__}, {torch.cuda.device_count()} GPU(s): "
        + ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())))
    log(f"NCCL {torch.cuda.nccl.version()}" if torch.cuda.is_available() else "no CUDA")
    prompts = greedy_prompts(args.num_prompts, args.max_token_id, min(512, args.max_model_len - args.max_new - 1))
    results, failed = {}, False
    if args.load_results:  # sizes measured by an earlier process: its GPU memory is surely free
        for f in sorted(Path(args.load_results).glob("result_tp*.json")):
            loaded = json.loads(f.read_text())
            results[loaded["tensor_parallel_size"]] = loaded
    for tp in [int(s) for s in args.sizes.split(",") if s]:  # "" runs the failure check alone
        start = time.perf_counter()
        try:
            results[tp] = run_size(tp, args, prompts)
            (out / f"result_tp{tp}.json").write_text(json.dumps(results[tp]))
        except Exception:
            failed = True
            log(f"TP={tp} failed:\n{traceback.format_exc()}")
        log(f"TP={tp}: {time.perf_counter() - start:.0f} s in all")
    summary: dict = {"model": args.model, "sizes": sorted(results)}
    sizes = sorted(results)
    if len(sizes) >= 2:
        base, top = sizes[0], sizes[-1]
        summary["greedy"] = compare(results[base]["greedy"], results[top]["greedy"])
        log(f"greedy TP={top} vs TP={base}: {summary['greedy']['identical_fraction']:.0%} of {len(prompts)} sequences "
            f"identical; first divergences at {summary['greedy']['first_divergence_positions']}, where TP={base}'s "
            f"logprob margins were {summary['greedy']['divergence_logprob_gaps']}; chosen tokens' logprobs within "
            f"{summary['greedy']['max_logprob_diff_before_divergence']} before")
        if "bench" in results[base] and "bench" in results[top]:
            ratio = results[top]["bench"]["tok_s"] / results[base]["bench"]["tok_s"]
            summary["tp_speedup"] = round(ratio, 3)
            log(f"throughput TP={top} / TP={base} = {ratio:.2f}x")
    summary["runs"] = {tp: {k: v for k, v in r.items() if k != "greedy"} for tp, r in results.items()}
    (out / "tp_check.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps({k: v for k, v in summary.items() if k != "runs"}), flush=True)
    LOG.write(json.dumps(summary) + "\n")
    LOG.flush()
    if not args.skip_failure_check and (args.device == "cpu" or torch.cuda.device_count() >= 2):
        start = time.perf_counter()
        try:
            check = failure_check(args)
        except Exception:
            check = {"ok": False, "error": traceback.format_exc()}
        check["seconds"] = round(time.perf_counter() - start, 1)
        log(f"failure check: {json.dumps({'failure_check': check})}")
        failed = failed or not check["ok"]
    LOG.close()
    compared = len(results) >= 2 or not [s for s in args.sizes.split(",") if s]  # "" asks for no comparison
    return 1 if failed or not compared else 0


if __name__ == "__main__":
    sys.exit(main())
