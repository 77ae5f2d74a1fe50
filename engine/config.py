"""Engine settings, checked and resolved against the model's config.json."""
from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine.attention import BACKENDS as ATTENTION_BACKENDS
from engine.builtin import BUILTIN_MODELS, TINY_MODEL_DIR
from engine.layers.quant import QuantMethod, parse_quantization
from engine.options import EngineOptions

log = logging.getLogger("redline.engine")

LOAD_FORMATS = ("auto", "safetensors", "dummy")
DTYPES = {"auto": None, "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
          "fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16, "half": torch.float16}
# "auto": the model's dtype; "fp8" (= "fp8_e4m3"): one byte an element, values cast with saturation and no
# scale, as vLLM's kv_cache_dtype="fp8" without calibrated scales
KV_CACHE_DTYPES = {"auto": None, "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn}
# "engine": on GPUs, the engine's symmetric-memory all-reduce kernels (decode steps) and copy-engine sums
# (large prefill steps); "nccl": every all-reduce in NCCL
TP_ALL_REDUCES = ("engine", "nccl")
# a CPU engine of a model this narrow or narrower runs torch on one thread: where another process holds a core,
# each op waits for a descheduled thread (2 cores, one busy: tiny 146-189 tok/s on torch's two threads, 1,078-1,347
# on one; the Qwen3-0.6B shape 222.7 s against 14.5 s: docs/performance.md); OMP_NUM_THREADS, where set, is kept
CPU_ONE_THREAD_MAX_HIDDEN_SIZE = 1024


@dataclass
class EngineConfig(EngineOptions):
    """The options (engine/options.py: defaults and help) checked, and resolved against the model's config.json."""

    # resolved in __post_init__
    model_dir: str = field(init=False)
    hf_config: object = field(init=False, repr=False)
    text_config: object = field(init=False, repr=False)  # the decoder's (hf_config itself for a text model)
    torch_dtype: torch.dtype = field(init=False)
    kv_torch_dtype: torch.dtype = field(init=False)
    eos_token_id: list[int] = field(init=False)
    cpu_threads: int | None = field(init=False)  # torch's threads for a CPU engine (None: torch's own count)
    quantization: QuantMethod | None = field(init=False, repr=False)  # the checkpoint's (engine/layers/quant)

    def __post_init__(self) -> None:
        self._check_options()
        self.device = resolve_device(self.device)
        _check_attention_backend(self.device, self.attention_backend)
        self.model_dir = resolve_model_dir(self.model, self.load_format)
        random_tiny = self.load_format == "auto" and self.model_dir == TINY_MODEL_DIR
        if random_tiny:
            self.load_format = "dummy"  # the tiny model ships no weights
        self.hf_config, self.quantization = load_hf_config(self.model_dir, with_quantization=True)
        self.text_config = self.hf_config.get_text_config()
        on_gpu = torch.device(self.device).type == "cuda"
        self.torch_dtype = DTYPES[self.dtype] or default_dtype(self.hf_config, on_gpu)
        self.kv_torch_dtype = KV_CACHE_DTYPES[self.kv_cache_dtype] or self.torch_dtype
        if self.kv_torch_dtype != self.torch_dtype:
            _check_fp8_kv(self.device, self.attention_backend)
        tp = self.tensor_parallel_size
        for name in ("num_attention_heads", "num_key_value_heads"):
            heads = getattr(self.text_config, name, None) or self.text_config.num_attention_heads
            if heads % tp:
                raise ValueError(f"{name} ({heads}) must be divisible by tensor_parallel_size ({tp})")
        max_pos = getattr(self.text_config, "max_position_embeddings", None) or 4096
        if self.max_model_len is None:
            self.max_model_len = min(max_pos, 4096 if on_gpu else 2048)
        if self.max_model_len > max_pos:
            raise ValueError(f"max_model_len is {self.max_model_len}; the model's max_position_embeddings is {max_pos}")
        if self.max_num_seqs is None:
            self.max_num_seqs = 512 if on_gpu else 64
        if self.max_seqs_per_request is None:
            self.max_seqs_per_request = max(1, self.max_num_seqs // 2)
        if self.max_seqs_per_request > self.max_num_seqs:
            raise ValueError(f"max_seqs_per_request is {self.max_seqs_per_request}; it must be at most max_num_seqs "
                             f"({self.max_num_seqs})")
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = 16384 if on_gpu else 2048
        if self.kvcache_block_size is None:
            self.kvcache_block_size = 256 if on_gpu else 16
        if self.async_scheduling is None:
            self.async_scheduling = on_gpu
        self.cpu_threads = None
        if not on_gpu and "OMP_NUM_THREADS" not in os.environ \
                and self.text_config.hidden_size <= CPU_ONE_THREAD_MAX_HIDDEN_SIZE:
            self.cpu_threads = 1
        eos = getattr(self.hf_config, "eos_token_id", None) or getattr(self.text_config, "eos_token_id", None)
        self.eos_token_id = [eos] if isinstance(eos, int) else list(eos or [])
        if random_tiny:
            log.warning("model %r is the built-in tiny model with RANDOM weights: its completions are gibberish",
                        self.model)

    def _check_options(self) -> None:
        """The values that need no model: checked before anything is resolved or downloaded."""
        for name, choices in (("load_format", LOAD_FORMATS), ("dtype", DTYPES), ("kv_cache_dtype", KV_CACHE_DTYPES),
                              ("attention_backend", ATTENTION_BACKENDS), ("tp_all_reduce", TP_ALL_REDUCES)):
            if getattr(self, name) not in choices:
                raise ValueError(f"{name} must be one of {', '.join(choices)}, got {getattr(self, name)!r}")
        if KV_CACHE_DTYPES[self.kv_cache_dtype] is not None and self.attention_backend == "flash":
            raise ValueError(f"kv_cache_dtype={self.kv_cache_dtype!r} is not supported by attention_backend='flash'; "
                             "use 'triton' or 'auto'")
        _positive_int("tensor_parallel_size", self.tensor_parallel_size)
        for name in ("max_num_seqs", "max_seqs_per_request", "max_num_batched_tokens", "max_model_len",
                     "kvcache_block_size", "num_kvcache_blocks", "max_images_per_prompt", "max_image_bytes",
                     "max_pixels_per_prompt", "max_loras", "max_lora_rank"):
            if getattr(self, name) is not None:
                _positive_int(name, getattr(self, name))
        util = self.gpu_memory_utilization
        if isinstance(util, bool) or not isinstance(util, (int, float)) or not 0 < util <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {util!r}")

    @property
    def max_blocks_per_seq(self) -> int:
        return (self.max_model_len + self.kvcache_block_size - 1) // self.kvcache_block_size


def set_tensor_parallel_gpu_environment() -> None:
    """The environment a GPU tensor-parallel engine's processes run in (its spawned ranks inherit it), where
    the user has not set it: NCCL errors do not end the process (rank 0 aborts the communicator itself, CUDA
    graphs first), and symmetric memory makes no NVLink multicast objects (the all-reduce kernels reach their
    peers' buffers through plain peer mappings; multicast would only take resources)."""
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")


def _positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _check_fp8_kv(device: str, attention_backend: str) -> None:
    """An fp8 KV cache (not with flash: _check_options) needs on CUDA a GPU that converts fp8 (sm_89+) for triton."""
    dev = torch.device(device)
    if dev.type == "cuda" and attention_backend != "torch":
        major, minor = torch.cuda.get_device_capability(dev)
        if (major, minor) < (8, 9):
            raise ValueError(f"kv_cache_dtype='fp8' needs compute capability 8.9 or later for the triton backend "
                             f"(this GPU is {major}.{minor}); use kv_cache_dtype='auto' or attention_backend='torch'")


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {device!r}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} asked for, but CUDA is not available here; use device='cpu'")
    return device


def _check_attention_backend(device: str, name: str) -> None:
    """What engine.attention.get_backend would refuse, said before the model loads."""
    if name in ("auto", "torch"):
        return
    if torch.device(device).type != "cuda":
        raise ValueError(f"attention_backend={name!r} needs a CUDA device, and this engine runs on {device}; "
                         "use 'auto' or 'torch'")
    if name == "flash":
        from engine.attention import flash_available, flash_missing
        if not flash_available():
            raise ValueError(f"attention_backend='flash' {flash_missing()}; or use 'auto'")


def default_dtype(hf_config, on_gpu: bool) -> torch.dtype:
    if not on_gpu:
        return torch.float32  # CPU matmuls in half precision are slow and inexact
    name = str(getattr(hf_config, "torch_dtype", None) or getattr(hf_config, "dtype", None) or "bfloat16")
    dtype = DTYPES.get(name.replace("torch.", ""), torch.bfloat16)
    return torch.bfloat16 if dtype == torch.float32 else dtype


def resolve_model_dir(model: str, load_format: str) -> str:
    """A local directory; else a built-in name (engine.builtin: "tiny", the shipped benchmark shapes);
    else an HF hub id, downloaded to the local cache."""
    if not isinstance(model, str) or not model:
        raise ValueError(f"model must be a local directory, an HF hub id or a built-in name, got {model!r}")
    path = Path(os.path.expanduser(model))
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"model directory {model!r} has no config.json")
        return str(path)
    if model in BUILTIN_MODELS:
        if BUILTIN_MODELS[model] != TINY_MODEL_DIR and load_format != "dummy":
            raise ValueError(f"model {model!r} is a shipped config with no weights: add load_format='dummy' "
                             "(--load-format dummy) for random weights, or name an HF hub id or a local checkpoint")
        return BUILTIN_MODELS[model]
    if path.exists() or model.count("/") != 1 or model.startswith((".", "/", "~")):
        raise ValueError(f"model {model!r} is not a directory with a config.json, an HF hub id like 'org/name', "
                         f"nor a built-in name ({', '.join(BUILTIN_MODELS)})")
    patterns = ["*.json", "*.jinja", "tokenizer*"] + ([] if load_format == "dummy" else ["*.safetensors"])
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError
    try:
        return snapshot_download(model, allow_patterns=patterns)
    except Exception as e:  # offline, unknown repo, gated repo, ...
        first_line = next((line for line in str(e).splitlines() if line.strip()), "")
        error = ConnectionError if isinstance(e, LocalEntryNotFoundError) else ValueError  # offline: unreachable
        raise error(f"model {model!r} is not a local directory and could not be fetched from the HF hub "
                    f"({type(e).__name__}: {first_line[:300]})") from None


def load_hf_config(model_dir: str, with_quantization: bool = False):
    """transformers' config of model_dir; with_quantization: (that, the checkpoint's QuantMethod or None). A
    quantization method the engine does not run is refused here, in one line naming it."""
    from transformers import AutoConfig

    from engine.models import model_class
    with open(Path(model_dir) / "config.json") as f:
        raw = json.load(f)
    model_class(raw.get("architectures"))  # clear error before transformers sees an unknown model type
    quantization = parse_quantization(raw)
    hf_config = AutoConfig.from_pretrained(model_dir)
    return (hf_config, quantization) if with_quantization else hf_config
