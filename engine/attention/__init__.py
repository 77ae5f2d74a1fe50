"""Attention over the paged KV cache: the per-step metadata and the backends.

The metadata rides in a ForwardContext that the model runner owns and its Attention layers share, so
two engines in one process never see each other's batch.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

BACKENDS = ("auto", "torch", "triton", "flash")


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor   # [num_tokens] flat cache slot of each new token, -1 = skip
    cu_seqlens_q: torch.Tensor   # [B + 1] int32
    seqlens_k: torch.Tensor      # [B] int32, context length including this step's tokens
    block_tables: torch.Tensor   # [B, max_blocks] int32, padded with -1
    max_seqlen_q: int
    max_seqlen_k: int
    is_decode: bool              # every query length is 1
    # what TritonBackend derives from the lengths once per forward pass for all its layers: the
    # sequences longest first
    decode_order: torch.Tensor | None = None
    # some query row is one token long (decode); False lets a prefill-only step skip the decode kernels
    has_decode_rows: bool = True


def has_decode_rows(cu_seqlens_q: torch.Tensor) -> bool:
    """Whether a batch's query lengths (cu_seqlens_q, on the host) include a one-token row."""
    return bool((cu_seqlens_q[1:] - cu_seqlens_q[:-1] == 1).any())


class ForwardContext:
    def __init__(self, backend):
        self.backend = backend
        self.meta: AttentionMetadata | None = None

    def prepare(self) -> None:
        """Before a forward pass's first layer: what the backend derives from the metadata once for every
        layer's attention (TritonBackend.prepare)."""
        prepare = getattr(self.backend, "prepare", None)
        if prepare is not None and self.meta is not None:
            prepare(self.meta)


def get_backend(name: str, device: torch.device, kv_cache_dtype: torch.dtype | None = None,
                attention_sinks: bool = False):
    """The backend for `name`; "auto" picks flash, then triton on CUDA, torch elsewhere (triton over flash
    for an fp8 KV cache, which flash does not read, and for a model with attention sinks, which it does not
    take)."""
    if name not in BACKENDS:
        raise ValueError(f"attention_backend must be one of {', '.join(BACKENDS)}, got {name!r}")
    if name == "auto":
        if device.type != "cuda":
            name = "torch"
        else:
            fp8 = kv_cache_dtype is not None and kv_cache_dtype.itemsize == 1
            name = "flash" if flash_available() and not fp8 and not attention_sinks else "triton"
    if name == "flash" and attention_sinks:
        raise ValueError("this model's attention sinks (gpt-oss) are not taken by attention_backend='flash'; "
                         "use 'triton' or 'auto'")
    if name != "torch" and device.type != "cuda":
        raise ValueError(f"attention_backend={name!r} needs a CUDA device; use 'torch' on {device.type}")
    if name == "torch":
        from engine.attention.torch_backend import TorchBackend
        return TorchBackend()
    if name == "triton":
        from engine.attention.triton_backend import TritonBackend
        return TritonBackend()
    if not flash_available():
        raise ValueError(f"attention_backend='flash' {flash_missing()}")
    from engine.attention.flash_backend import FlashBackend
    return FlashBackend()


def flash_available() -> bool:
    """Whether the flash backend can run here (the flash_attn package and what it needs)."""
    try:
        from engine.attention.flash_backend import flash_available as installed
    except ImportError:
        return False
    return installed()


def flash_missing() -> str:
    """What the flash backend lacks here, as the end of a sentence: the package, or why it does not load."""
    try:
        from engine.attention.flash_backend import flash_import_errors
    except ImportError as e:  # no triton: the engine's KV-cache kernel, which the backend writes with
        return f"needs triton ({e})"
    errors = flash_import_errors()
    if errors:  # a build that does not match this torch or GPU: the commonest failure
        return f"cannot load the installed flash_attn: {errors[0]}"
    return "needs the flash_attn package (pip install 'redline[flash]')"
