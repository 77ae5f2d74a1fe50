"""Where a decode step's decoder layers run as one persistent kernel (engine/kernels/decode_stack.py).

A decode batch of one sequence on one CUDA GPU, with the triton attention backend, a cache of the
model's dtype and projections without bias, runs every layer in one launch instead of five kernels a
layer, with REDLINE_DECODE_STACK=1 (off by default until measured on a GPU).
"""
from __future__ import annotations

import functools
import os

import torch

from engine.config import switch_setting

_UNSUPPORTED = object()  # the model was looked at and the stack does not take it


@functools.cache
def stack_setting() -> bool:
    """REDLINE_DECODE_STACK, read once (the layers ask every batch-1 step)."""
    return switch_setting("REDLINE_DECODE_STACK", "0")


def _layer_tensors(layer) -> dict:
    attn = layer.self_attn
    return {"qkv": attn.qkv_proj.weight, "o": attn.o_proj.weight, "gate_up": layer.mlp.gate_up_proj.weight,
            "down": layer.mlp.down_proj.weight, "input_norm": layer.input_layernorm.weight,
            "post_norm": layer.post_attention_layernorm.weight,
            "q_norm": attn.q_norm.weight if attn.qk_norm else None,
            "k_norm": attn.k_norm.weight if attn.qk_norm else None,
            "k_cache": attn.attn.k_cache, "v_cache": attn.attn.v_cache}


def _applies(model, x: torch.Tensor) -> bool:
    first = model.layers[0]
    attn = first.self_attn
    meta = attn.attn.ctx.meta
    return (x.is_cuda and x.dim() == 2 and x.shape[0] == 1 and stack_setting() and meta is not None
            and meta.is_decode and getattr(attn.attn.ctx.backend, "name", None) == "triton"
            and os.environ.get("REDLINE_COMPILE", "1") != "0"
            and attn.qkv_proj.tp.size == 1 and attn.qkv_proj.bias is None and attn.o_proj.bias is None
            and attn.attn.k_cache.dtype == x.dtype and meta.block_tables.shape[0] == 1
            and meta.block_tables.stride(1) == 1 and meta.seqlens_k.dtype == torch.int32
            and meta.slot_mapping.dtype == torch.int64)


def _stack(model, x: torch.Tensor):
    """The model's DecodeStack, built on first use outside a CUDA graph capture (its table is copied to the
    device) and kept while the caches stay; None where it does not take the model."""
    from engine.kernels.decode_stack import DecodeStack

    first = model.layers[0].self_attn
    key = (first.attn.k_cache.data_ptr(), x.device)
    cached = getattr(model, "_decode_stack", None)
    if cached is not None and cached[0] == key:
        return None if cached[1] is _UNSUPPORTED else cached[1]
    if torch.cuda.is_current_stream_capturing():
        return None
    try:
        stack = DecodeStack([_layer_tensors(layer) for layer in model.layers], first.num_heads, first.num_kv_heads,
                            model.layers[0].input_layernorm.eps, first.q_norm.eps if first.qk_norm else 0.0,
                            first.attn.scale)
    except ValueError:  # a shape or layout the kernel does not take: the layers run one by one
        stack = _UNSUPPORTED
    model._decode_stack = (key, stack)
    return None if stack is _UNSUPPORTED else stack


def run_stack(model, x: torch.Tensor, positions: torch.Tensor):
    """(hidden, residual) after every layer through the persistent kernel, or None where it does not apply."""
    if not _applies(model, x):
        return None
    stack = _stack(model, x)
    if stack is None:
        return None
    meta = model.layers[0].self_attn.attn.ctx.meta
    rotary = model.layers[0].self_attn.rotary_emb
    return stack(x, positions, meta.slot_mapping, meta.seqlens_k, meta.block_tables[0], rotary.cos, rotary.sin)
