"""The engine's options, declared once: each field's default and help. `EngineConfig` (engine/config.py)
checks and resolves them against the model; `redline worker` makes each one a flag (and a REDLINE_<NAME>
variable) from these fields. Imports no torch, so the CLI lists the options without loading it."""
from __future__ import annotations

from dataclasses import dataclass, field

from engine.inputs.images import MAX_IMAGE_BYTES, MAX_IMAGES_PER_PROMPT, MAX_PIXELS_PER_PROMPT


def _option(default, help: str):
    """A field with its one-line help (what `redline worker --help` prints for it)."""
    return field(default=default, metadata={"help": help})


@dataclass
class EngineOptions:
    model: str
    load_format: str = _option("auto", "auto | safetensors | dummy (random weights from config.json)")
    dtype: str = _option("auto", "auto (the model's; float32 on CPU) | bfloat16 | float16 | float32")
    device: str = _option("auto", "auto | cuda | cuda:N | cpu")
    tensor_parallel_size: int = _option(1, "GPUs the model is split across")
    max_num_seqs: int | None = _option(None, "sequences in one batch [512 on GPUs, 64 on CPU]")
    # the most of max_num_seqs one request (n, best_of, beam_width) may hold, so that one request never takes
    # every slot from the others for as long as it runs
    max_seqs_per_request: int | None = _option(None, "most of max_num_seqs one request (n, best_of, beam_width) "
                                                     "may hold [max_num_seqs // 2]")
    max_num_batched_tokens: int | None = _option(None, "tokens in one engine step [16384 on GPUs, 2048 on CPU]")
    max_model_len: int | None = _option(None, "prompt plus completion tokens [the model's, at most 4096 on GPUs, "
                                              "2048 on CPU]")
    gpu_memory_utilization: float = _option(0.9, "share of GPU memory to use")
    kvcache_block_size: int | None = _option(None, "tokens per KV block [256 on GPUs, 16 on CPU]")
    num_kvcache_blocks: int | None = _option(None, "fix the KV cache size [as many as fit]")
    enable_prefix_caching: bool = _option(True, "reuse KV blocks of shared prefixes")
    # measured off by default until the shared-prefix benchmark shows it wins (docs/performance.md)
    prefer_cached_prefixes: bool = _option(False, "admit waiting requests whose prompt prefix is cached first")
    enforce_eager: bool = _option(False, "no CUDA graphs")
    attention_backend: str = _option("auto", "auto | triton | flash | torch")
    kv_cache_dtype: str = _option("auto", "auto (the model's dtype) | fp8 (one byte an element, lossy)")
    async_scheduling: bool | None = _option(None, "prepare the next step while the GPU runs this one [on for GPUs]")
    seed: int = _option(0, "seed of dummy weights and of unseeded sampling")
    # False: the layers' norms, activations and projections run as plain PyTorch ops (no torch.compile, none
    # of the engine's Triton layer kernels; attention keeps its backend), to debug
    fused_layers: bool = _option(True, "off: the layers as plain PyTorch ops (debugging)")
    tp_all_reduce: str = _option("engine", "engine (the engine's all-reduce kernels on GPUs) | nccl")
    enable_lora: bool = _option(False, "serve LoRA adapters per request (engine/lora)")
    max_loras: int = _option(4, "LoRA adapters held on the device at once (slots)")
    max_lora_rank: int = _option(64, "largest LoRA rank an adapter may have")
    max_images_per_prompt: int = _option(MAX_IMAGES_PER_PROMPT, "vision-language models: most images in one job")
    max_image_bytes: int = _option(MAX_IMAGE_BYTES, "vision-language models: most bytes of one encoded image")
    max_pixels_per_prompt: int = _option(MAX_PIXELS_PER_PROMPT, "vision-language models: most pixels (width x "
                                                                "height) of one job's images together")
