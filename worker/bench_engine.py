"""The engine-alone benchmark: nano-vllm's bench workload on dummy weights of a shipped config.

Workload (docs/DESIGN): random.seed(0); 256 prompts of randint(100, 1024) ids in [0, 10000]; then for
each, max_tokens=randint(100, 1024), ignore_eos; 133,966 output tokens. Throughput is output tokens
over the wall seconds of one generate() after a warm-up. The floor is the time to read, at the GPU's
bandwidth, every generated token's context K/V once plus the weights once per decode step.
"""
from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from engine.builtin import BUILTIN_MODELS, SHIPPED_CONFIGS, TINY_MODEL_DIR

DEFAULT_MODEL = "qwen3-0.6b"
DEFAULT_MAX_TOKEN_ID = 10000
# bytes/s read + written by a device-to-device copy, measured on the lent machines (shared/GPU.md)
MEASURED_BANDWIDTH = {"H100": 3.02e12, "H200": 4.3e12}
# --quantization: the quantization_config a shipped shape is given for its dummy weights, as the hub's quantized
# checkpoints of that shape publish it (Qwen3-8B-FP8: blocks of 128 x 128, dynamic per-token-group activations)
BENCH_QUANTIZATIONS = {
    "fp8": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]},
    "fp8-tensor": {"quant_method": "fp8", "activation_scheme": "dynamic"},
    "awq": {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"},
    "mxfp4": {"quant_method": "mxfp4",  # gpt-oss's experts, as OpenAI publishes them
              "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                         "model.embed_tokens", "lm_head"]},
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The workload and engine options of `redline bench`."""
    w = parser.add_argument_group("workload (defaults: nano-vllm's bench)")
    w.add_argument("--model", default=DEFAULT_MODEL,
                   help=f"config dir, HF id, or a built-in name (tiny, {', '.join(SHIPPED_CONFIGS)}); "
                        "default: the Qwen3-0.6B shape")
    w.add_argument("--load-format", default="dummy", help="dummy (random weights) or auto (real checkpoint)")
    w.add_argument("--num-seqs", type=int, default=256)
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--min-input-len", type=int, default=100)
    w.add_argument("--max-input-len", type=int, default=1024)
    w.add_argument("--min-output-len", type=int, default=100)
    w.add_argument("--max-output-len", type=int, default=1024)
    w.add_argument("--max-token-id", type=int, default=DEFAULT_MAX_TOKEN_ID,
                   help="prompt ids are drawn from [0, this] (the default is cut to a smaller vocabulary)")
    w.add_argument("--temperature", type=float, default=0.6, help="0 for greedy")
    w.add_argument("--json-schema", default=None, metavar="FILE",
                   help="structured output: every completion follows this JSON schema and ends where its JSON "
                        "does (needs a model with a tokenizer; the shipped shapes have none)")
    w.add_argument("--caption-images", action="store_true",
                   help="the captioning workload instead (worker/bench_vision.py): one image a request on a "
                        "vision-language model (default: the qwen2.5-vl-3b shape); reports the vision tower's share")
    w.add_argument("--image-size", default="448x448", metavar="WxH", help="--caption-images: each image's pixels")
    w.add_argument("--bandwidth", type=float, default=None,
                   help="GPU memory bandwidth in bytes/s for the floor (default: measured figure for the GPU)")
    e = parser.add_argument_group("engine")
    e.add_argument("--max-num-seqs", type=int, default=None)
    e.add_argument("--max-num-batched-tokens", type=int, default=None)
    e.add_argument("--max-model-len", type=int, default=4096)
    e.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    e.add_argument("--kvcache-block-size", type=int, default=None)
    e.add_argument("--enforce-eager", action="store_true")
    e.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "triton", "flash"])
    e.add_argument("--tensor-parallel-size", type=int, default=1)
    e.add_argument("--dtype", default="auto")
    e.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e4m3"],
                   help="auto: the model's dtype; fp8: a one-byte KV cache (lossy, opt-in)")
    e.add_argument("--device", default="auto")
    e.add_argument("--quantization", default=None, choices=sorted(BENCH_QUANTIZATIONS),
                   help="dummy weights quantized as the hub's checkpoints of that method are (fp8: Qwen3-*-FP8's "
                        "block-wise fp8; fp8-tensor: one scale per tensor): random fp8 weights with unit scales; "
                        "awq: int4 in groups of 128 (AWQ gemm); mxfp4: gpt-oss's MXFP4 experts")
    r = parser.add_argument_group("record")
    r.add_argument("--commit", default=None,
                   help="the commit the JSON record names (default: git rev-parse --short HEAD of this checkout)")
    from worker import bench_embed  # its module imports this one
    bench_embed.add_arguments(parser)


def resolve_model(model: str) -> str:
    """The directory a built-in name stands for (a local directory of that name wins); others as given."""
    return model if Path(model).is_dir() else BUILTIN_MODELS.get(model, model)


def check_arguments(args: argparse.Namespace) -> None:
    """Refuse, before anything loads, a workload that cannot be drawn, and a GPU benchmark that would
    crawl on a machine without CUDA. Raises ValueError naming the flag."""
    for low, high in (("min_input_len", "max_input_len"), ("min_output_len", "max_output_len")):
        lo, hi = getattr(args, low), getattr(args, high)
        if lo < 1:
            raise ValueError(f"{_flag(low)} must be at least 1, got {lo}")
        if lo > hi:
            raise ValueError(f"{_flag(low)} ({lo}) is more than {_flag(high)} ({hi}); set both so that min <= max")
    for name, least in (("num_seqs", 1), ("max_token_id", 0), ("temperature", 0)):
        if getattr(args, name) < least:
            raise ValueError(f"{_flag(name)} must be at least {least}, got {getattr(args, name)}")
    if args.bandwidth is not None and args.bandwidth <= 0:
        raise ValueError(f"--bandwidth must be positive (bytes/s), got {args.bandwidth}")
    if getattr(args, "json_schema", None) is not None:
        args.json_schema_value = _json_schema(args)
    if args.max_token_id == DEFAULT_MAX_TOKEN_ID:
        args.max_token_id = min(DEFAULT_MAX_TOKEN_ID, _vocab_size(args.model) - 1)
    if getattr(args, "quantization", None) and args.load_format != "dummy":
        raise ValueError("--quantization makes quantized dummy weights; for a quantized checkpoint's own weights, "
                         "point --model at it with --load-format auto (its config.json says its quantization)")
    import torch

    if args.device == "auto" and resolve_model(args.model) != TINY_MODEL_DIR and not torch.cuda.is_available():
        raise ValueError(f"no CUDA GPU here, and the {Path(resolve_model(args.model)).name} workload would take "
                         "very long on CPU; try --model tiny --num-seqs 16 (the built-in tiny model), or --device cpu to run it anyway")


def _json_schema(args: argparse.Namespace) -> dict:
    """The schema of --json-schema, checked as SamplingParams checks it; ValueError naming the flag."""
    from engine.inputs.tokenizer import TOKENIZER_FILES
    from engine.sampling.params import SamplingParams

    path = args.json_schema
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ValueError(f"--json-schema: cannot read {path}: {e.strerror or e}") from None
    try:
        schema = SamplingParams(json_schema=text).json_schema
    except ValueError as e:
        raise ValueError(f"--json-schema {path}: {e}") from None
    model_dir = Path(resolve_model(args.model))
    if model_dir.is_dir() and not any((model_dir / name).is_file() for name in TOKENIZER_FILES):
        raise ValueError(f"--json-schema needs a model with a tokenizer; {model_dir.name} has none (point --model "
                         "at a checkpoint directory, or use --model tiny)")
    return schema


def _vocab_size(model: str) -> int:
    """The vocabulary of a local or built-in model (a large one for a hub id not downloaded yet)."""
    try:
        with open(Path(resolve_model(model)) / "config.json") as f:
            return int(json.load(f).get("vocab_size") or DEFAULT_MAX_TOKEN_ID + 1)
    except (OSError, ValueError):
        return DEFAULT_MAX_TOKEN_ID + 1


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def make_workload(args: argparse.Namespace):
    """(prompts as token-id lists, one SamplingParams each), drawn exactly as nano-vllm's bench draws them."""
    from engine.sampling.params import SamplingParams

    random.seed(args.seed)
    prompts = [[random.randint(0, args.max_token_id) for _ in range(random.randint(args.min_input_len, args.max_input_len))]
               for _ in range(args.num_seqs)]
    schema = getattr(args, "json_schema_value", None)
    params = [SamplingParams(temperature=args.temperature, ignore_eos=True, json_schema=schema,
                             max_tokens=random.randint(args.min_output_len, args.max_output_len))
              for _ in range(args.num_seqs)]
    return prompts, params


def build_llm(args: argparse.Namespace):
    """The engine under test, with dummy weights unless --load-format says otherwise."""
    from engine import LLM

    model = args.model
    if getattr(args, "quantization", None):
        model = quantized_shape(resolve_model(args.model), BENCH_QUANTIZATIONS[args.quantization])
    return LLM(model, load_format=args.load_format, dtype=args.dtype, device=args.device,
               tensor_parallel_size=args.tensor_parallel_size, max_num_seqs=args.max_num_seqs,
               max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
               gpu_memory_utilization=args.gpu_memory_utilization, kvcache_block_size=args.kvcache_block_size,
               enforce_eager=args.enforce_eager, attention_backend=args.attention_backend,
               kv_cache_dtype=args.kv_cache_dtype, num_kvcache_blocks=getattr(args, "num_kvcache_blocks", None))


def quantized_shape(model_dir: str, quantization_config: dict) -> str:
    """A temporary copy of model_dir's files whose config.json has quantization_config: the engine then builds the
    shape's linear layers quantized, and load_format='dummy' fills them with random fp8 weights."""
    import shutil
    import tempfile

    out = Path(tempfile.mkdtemp(prefix="redline-bench-"))
    for f in Path(model_dir).iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            shutil.copy(f, out / f.name)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "quantization_config": quantization_config}))
    return str(out)


def floor_seconds(hf_config, prompts: list[list[int]], params, bandwidth: float, dtype_bytes: int = 2,
                  tensor_parallel_size: int = 1, kv_dtype_bytes: int | None = None) -> float:
    """Bytes that must cross device memory (each generated token's context K/V once, in a sliding-window
    layer only the window's, the weights once per decode step, all sequences decoding together; of a
    mixture of experts, the experts the step's sequences route to) over the bandwidth. kv_dtype_bytes: bytes of a cached K/V element (default dtype_bytes; 1 for an fp8 cache)."""
    from engine.models import model_class

    layer_kv = kv_bytes_per_token(hf_config, kv_dtype_bytes or dtype_bytes) // hf_config.num_hidden_layers
    windows = model_class(hf_config.architectures).layer_windows(hf_config)
    context_bytes = 0
    for prompt, sp in zip(prompts, params):
        for window in windows:
            context_bytes += attended_positions(len(prompt), sp.max_tokens, window) * layer_kv
    lengths = [sp.max_tokens for sp in params]
    if moe_shape(hf_config) is None:
        weight_bytes = max(lengths) * count_parameters(hf_config) * dtype_bytes
    else:  # a step reads the experts its sequences route to: fewer as sequences finish
        weight_bytes = sum(count_parameters(hf_config, sum(n > step for n in lengths))
                           for step in range(max(lengths))) * dtype_bytes
    return (context_bytes + weight_bytes) / (bandwidth * tensor_parallel_size)


def attended_positions(prompt_len: int, new_tokens: int, window: int = 0) -> int:
    """Context positions the generated tokens of one sequence read in one layer: the i-th reads prompt_len + i,
    or at most window of them in a sliding-window layer (window 0: none)."""
    total = new_tokens * prompt_len + new_tokens * (new_tokens - 1) // 2
    if window <= 0:
        return total
    below = min(max(window - prompt_len, 0), new_tokens)  # tokens whose context is still within the window
    return below * prompt_len + below * (below - 1) // 2 + (new_tokens - below) * window


def kv_bytes_per_token(hf_config, kv_dtype_bytes: int = 2) -> int:
    """Bytes of one token's cached K and V over every layer."""
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    return hf_config.num_hidden_layers * 2 * hf_config.num_key_value_heads * head_dim * kv_dtype_bytes


def count_parameters(c, batch: int | None = None) -> float:
    """Parameters of a Llama/Qwen-style decoder from its config (tied embeddings counted once). Of a mixture of
    experts, those a decode step of `batch` sequences reads: each sparse layer's experts expected to serve one
    of their batch * top-k uniformly routed picks (None: every expert)."""
    h, vocab = c.hidden_size, c.vocab_size
    head_dim = getattr(c, "head_dim", None) or h // c.num_attention_heads
    q, kv = c.num_attention_heads * head_dim, c.num_key_value_heads * head_dim
    attention = h * q + 2 * h * kv + q * h + 2 * h + 2 * head_dim
    dense_mlp = 3 * h * c.intermediate_size
    layers = c.num_hidden_layers * (attention + dense_mlp)
    moe = moe_shape(c)
    if moe is not None:
        sparse, num_experts, top_k, per_expert = moe
        touched = num_experts if batch is None else num_experts * (1 - (1 - top_k / num_experts) ** batch)
        shared = getattr(c, "shared_expert_intermediate_size", 0) or 0
        sparse_mlp = h * num_experts + touched * per_expert + (3 * h * shared + h if shared else 0)
        layers += sparse * (sparse_mlp - dense_mlp)
    lm_head = 0 if getattr(c, "tie_word_embeddings", False) else vocab * h
    return vocab * h + layers + h + lm_head


def moe_shape(c) -> tuple[int, int, int, int] | None:
    """(sparse layers, experts, top-k, parameters of one expert) of a mixture-of-experts config, else None."""
    num_experts = getattr(c, "num_experts", None) or getattr(c, "num_local_experts", None)
    if not num_experts:
        return None
    inter = getattr(c, "moe_intermediate_size", None) or c.intermediate_size
    dense = set(getattr(c, "mlp_only_layers", None) or [])
    step = getattr(c, "decoder_sparse_step", None) or 1
    sparse = sum(1 for i in range(c.num_hidden_layers) if i not in dense and (i + 1) % step == 0)
    return sparse, num_experts, c.num_experts_per_tok, 3 * c.hidden_size * inter


def gpu_name() -> str:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def git_commit(commit: str | None = None) -> str:
    """`commit` if given (--commit), else this checkout's HEAD, or "unknown"."""
    if commit:
        return commit
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=Path(__file__).parent,
                             capture_output=True, text=True, timeout=10)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def default_bandwidth(gpu: str) -> float | None:
    return next((bw for key, bw in MEASURED_BANDWIDTH.items() if key in gpu), None)


def warm_up(llm, args: argparse.Namespace) -> None:
    """Compile and capture before the clock starts. Triton specialises kernels on their integer arguments
    (decode splits, the sampler's split count and its padding follow the batch size; prefill tiles follow
    the lengths), so the warm-up runs as many prompts as the workload, with its length range, and lets
    the batch shrink through every size range the timed run passes: outputs of 1..24 tokens, then 16
    prompts ending one step apart. Its prompts are not the workload's, so the prefix cache stays cold
    for it. The bench reports any kernel compiled inside the timed run all the same."""
    from engine.sampling.params import SamplingParams

    rng = random.Random(args.seed + 1)
    prompts = [[rng.randint(0, args.max_token_id) for _ in range(rng.randint(args.min_input_len, args.max_input_len))]
               for _ in range(args.num_seqs)]
    longest = min(24, args.max_output_len)

    def params(count: int, spread: int) -> list:
        return [SamplingParams(temperature=args.temperature, ignore_eos=True, max_tokens=1 + i % spread)
                for i in range(count)]

    llm.generate(prompts, params(len(prompts), longest), use_tqdm=False)
    llm.generate(prompts[:16], params(min(16, len(prompts)), 16), use_tqdm=False)


def _triton_cache() -> Path | None:
    try:
        from triton import knobs
        return Path(knobs.cache.dir)
    except Exception:  # noqa: BLE001 (no Triton, or one without knobs: nothing to count)
        return None


def compiled_kernels() -> int:
    """Kernels in Triton's on-disk cache (every process of this user and machine adds its compiles there,
    tensor-parallel ranks included); 0 without Triton."""
    cache = _triton_cache()
    return sum(1 for _ in cache.iterdir()) if cache is not None and cache.is_dir() else 0


def kernels_compiled_since(since: float) -> list[str]:
    """Names of the kernels Triton compiled into its cache since `since` (a time.time() value)."""
    cache = _triton_cache()
    if cache is None or not cache.is_dir():
        return []
    return sorted(f.stem for d in cache.iterdir() if d.stat().st_mtime >= since
                  for f in d.glob("*.json") if not f.name.startswith("__grp__"))


def warn_if_compiled(count: int, names: list[str] = ()) -> None:
    if count:
        print(f"warning: {count} Triton kernels were compiled during the timed run, so its time includes "
              f"compiling{' (' + ', '.join(names) + ')' if names else ''}; run the bench again (the cache keeps them)",
              file=sys.stderr)


def watch_compiles():
    """Call before a timed run; the function it returns, called after the run, warns about the kernels
    Triton compiled in between and returns (how many, their names)."""
    cached, since = compiled_kernels(), time.time()

    def done() -> tuple[int, list[str]]:
        count = compiled_kernels() - cached
        names = kernels_compiled_since(since) if count else []
        warn_if_compiled(count, names)
        return count, names
    return done


def run(args: argparse.Namespace) -> dict:
    """Warm up, time one generate of the workload, print a summary and one JSON line; return the record."""
    if getattr(args, "caption_images", False):
        from worker import bench_vision
        return bench_vision.run(args)
    if getattr(args, "embed", False):
        from worker import bench_embed
        return bench_embed.run(args)
    check_arguments(args)
    prompts, params = make_workload(args)
    llm = build_llm(args)
    warm_up(llm, args)
    compiles = watch_compiles()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    compiled, _ = compiles()
    tokens = sum(len(o.token_ids) for o in outputs)
    expected = sum(sp.max_tokens for sp in params)
    gpu = gpu_name()
    bandwidth = args.bandwidth or default_bandwidth(gpu)
    config = llm.config
    floor = None
    constrained = params[0].json_schema is not None  # completions end where their JSON does: no fixed count
    quantization = getattr(args, "quantization", None)
    if bandwidth and not constrained and not quantization:  # the floor counts weights of the model's dtype
        floor = floor_seconds(config.hf_config, prompts, params, bandwidth,
                              config.torch_dtype.itemsize, config.tensor_parallel_size, config.kv_torch_dtype.itemsize)
    record = {
        "gpu": gpu, "commit": git_commit(getattr(args, "commit", None)), "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
        "model": Path(resolve_model(args.model)).name, "backend": llm.runner.ctx.backend.name
        if hasattr(llm.runner, "ctx") else args.attention_backend,
        "enforce_eager": args.enforce_eager, "kv_cache_dtype": config.kv_cache_dtype, "num_seqs": args.num_seqs,
        "quantization": quantization,
        "tokens": tokens,
        "seconds": round(seconds, 3), "tok_s": round(tokens / seconds, 1),
        "floor_seconds": round(floor, 3) if floor else None,
        "ratio_to_floor": round(seconds / floor, 2) if floor else None,
        "kernels_compiled_in_run": compiled,
        "json_schema": args.json_schema if constrained else None,
    }
    kv_note = "" if config.kv_cache_dtype == "auto" else f", {config.kv_cache_dtype} KV cache"
    kv_note += f", {quantization} weights" if quantization else ""
    print(f"{record['model']} on {gpu} ({record['backend']} attention{kv_note}): {tokens} tokens in {seconds:.2f} s "
          f"= {tokens / seconds:,.0f} tok/s" + (f"; floor {floor:.2f} s, {seconds / floor:.1f}x the floor" if floor else ""))
    if tokens != expected and not constrained:
        print(f"warning: generated {tokens} tokens, the workload asks for {expected}", file=sys.stderr)
    print(json.dumps(record), flush=True)
    shutdown = getattr(llm, "shutdown", None)
    if shutdown:
        shutdown()
    return record


def register(subparsers) -> None:
    """`bench` as a subcommand (engine alone), for use without the worker's CLI."""
    parser = subparsers.add_parser("bench", help="nano-vllm's bench workload on the engine alone")
    add_arguments(parser)
    parser.set_defaults(func=run)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m worker.bench_engine", description=__doc__.splitlines()[0])
    add_arguments(parser)
    run(parser.parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
