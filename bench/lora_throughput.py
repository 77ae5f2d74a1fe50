"""Reproduces docs/lora.md's LoRA throughput: nano-vllm's bench workload with every sequence under one of
8 rank-16 adapters (all seven projections adapted, random weights), against the base model, on one engine in one
process (the same GPU, the same warm-up).
    python3 bench/lora_throughput.py [--num-adapters 8] [--lora-rank 16] [worker.bench_engine's options]

Prints one JSON line: base and LoRA tokens/s and their ratio.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the tree this script is in

from engine import LLM, LoRARequest  # noqa: E402
from engine.lora.adapter import TARGET_MODULES  # noqa: E402
from worker import bench_engine as bench  # noqa: E402


def write_adapter(hf_config, out_dir: Path, rank: int, seed: int) -> Path:
    """A PEFT-format adapter of every projection of every layer, random A and B, as save_pretrained lays it out."""
    from safetensors.torch import save_file

    c = hf_config.get_text_config()
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    q, kv = c.num_attention_heads * head_dim, c.num_key_value_heads * head_dim
    shapes = {"q_proj": (c.hidden_size, q), "k_proj": (c.hidden_size, kv), "v_proj": (c.hidden_size, kv),
              "o_proj": (q, c.hidden_size), "gate_proj": (c.hidden_size, c.intermediate_size),
              "up_proj": (c.hidden_size, c.intermediate_size), "down_proj": (c.intermediate_size, c.hidden_size)}
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(c.num_hidden_layers):
        for name, (fan_in, fan_out) in shapes.items():
            where = "self_attn" if name in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{where}.{name}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, fan_in, generator=gen) * fan_in ** -0.5
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(fan_out, rank, generator=gen) * 0.01
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / "adapter_model.safetensors"))
    (out_dir / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGET_MODULES),
        "bias": "none", "use_rslora": False, "fan_in_fan_out": False}))
    return out_dir


def timed(llm, prompts, params, loras) -> tuple[int, float]:
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    return sum(len(o.token_ids) for o in outs), time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    parser.add_argument("--num-adapters", type=int, default=8)
    parser.add_argument("--lora-rank", type=int, default=16)
    args = parser.parse_args()
    bench.check_arguments(args)
    prompts, params = bench.make_workload(args)
    llm = LLM(args.model, load_format=args.load_format, dtype=args.dtype, device=args.device,
              tensor_parallel_size=args.tensor_parallel_size, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
              gpu_memory_utilization=args.gpu_memory_utilization, kvcache_block_size=args.kvcache_block_size,
              enforce_eager=args.enforce_eager, attention_backend=args.attention_backend,
              kv_cache_dtype=args.kv_cache_dtype, enable_lora=True, max_loras=args.num_adapters,
              max_lora_rank=args.lora_rank)
    with tempfile.TemporaryDirectory() as tmp:
        adapters = [LoRARequest(f"a{i}", i + 1, str(write_adapter(llm.config.hf_config, Path(tmp) / f"a{i}",
                                                                     args.lora_rank, seed=i)))
                    for i in range(args.num_adapters)]
        loras = [adapters[i % len(adapters)] for i in range(len(prompts))]
        bench.warm_up(llm, args)
        llm.generate(prompts[:64], params[:64], use_tqdm=False,
                     lora_request=loras[:64])  # the LoRA path's kernels compile here
        base_tokens, base_s = timed(llm, prompts, params, None)
        lora_tokens, lora_s = timed(llm, prompts, params, loras)
    record = {"gpu": bench.gpu_name(), "commit": bench.git_commit(), "model": Path(bench.resolve_model(args.model)).name,
              "num_adapters": args.num_adapters, "rank": args.lora_rank,
              "base_tok_s": round(base_tokens / base_s, 1), "lora_tok_s": round(lora_tokens / lora_s, 1),
              "ratio": round((lora_tokens / lora_s) / (base_tokens / base_s), 3), "tokens": [base_tokens, lora_tokens]}
    print(json.dumps(record), flush=True)
    llm.shutdown()


if __name__ == "__main__":
    main()
