"""The `flash` attention backend: the card's flash-attn, when the `flash_attn` package is importable.

Two generations are understood:
- flash-attn 2 (`flash_attn.flash_attn_varlen_func` / `flash_attn_with_kvcache`, a source build):
  paged KV needs a block size that is a multiple of 256.
- flash-attn 4 (`flash_attn.cute.flash_attn_varlen_func`, wheels, Hopper and Blackwell): paged
  varlen attention through `page_table` + `seqused_k`, any page size.
New K/V go into the cache through the engine's Triton kernel either way. A sliding window and attention-logit
soft-capping are flash-attn's own window_size and softcap arguments; attention sinks (gpt-oss) are not
taken: such a model runs on the triton backend.
"""
from __future__ import annotations

import functools
import importlib.util
from typing import TYPE_CHECKING, Callable

import torch
import torch.nn.functional as F

from engine.kernels import store_kvcache

if TYPE_CHECKING:
    from engine.attention import AttentionMetadata


_import_errors: list[str] = []


@functools.cache
def _flash_api() -> tuple[str, tuple[Callable, ...]] | None:
    """("fa2", (varlen, with_kvcache)) or ("fa4", (varlen,)) or None when nothing is importable."""
    if importlib.util.find_spec("flash_attn") is None:
        return None
    try:
        from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache
        return "fa2", (flash_attn_varlen_func, flash_attn_with_kvcache)
    except Exception as e:  # ImportError, or a broken build failing to load its library
        _import_errors.append(f"flash_attn (2): {e!r}")
    try:
        from flash_attn.cute import flash_attn_varlen_func
        return "fa4", (flash_attn_varlen_func,)
    except Exception as e:
        _import_errors.append(f"flash_attn.cute (4): {e!r}")
        return None


def flash_import_errors() -> list[str]:
    """Why flash_attn was found but not usable (empty when it imported or is absent)."""
    _flash_api()
    return list(_import_errors)


def flash_available() -> bool:
    return torch.cuda.is_available() and _flash_api() is not None


class FlashBackend:
    """Paged attention through flash-attn (2 or 4, whichever the card has)."""

    name = "flash"

    def __init__(self) -> None:
        api = _flash_api()
        if api is None:
            raise ImportError("the flash backend needs flash_attn (flash-attn 2) or flash_attn.cute (flash-attn 4)")
        self.flavor, self._funcs = api
        # flash-attn 2's paged path is what nano-vllm captures; flash-attn 4's is not verified in graphs
        self.supports_cuda_graphs = self.flavor == "fa2"

    def store_kvcache(self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        store_kvcache(key, value, k_cache, v_cache, slot_mapping)

    def forward(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: "AttentionMetadata", scale: float, window: int = 0, softcap: float = 0.0,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        if sinks is not None:
            raise ValueError("attention sinks (gpt-oss) are not supported by attention_backend='flash'; "
                             "use 'triton' or 'auto'")
        if self.flavor == "fa4":
            return self._forward_fa4(q, k_cache, v_cache, meta, scale, window, softcap)
        return self._forward_fa2(q, k_cache, v_cache, meta, scale, window, softcap)

    def _forward_fa2(self, q, k_cache, v_cache, meta, scale, window, softcap) -> torch.Tensor:
        varlen, with_kvcache = self._funcs
        if k_cache.shape[1] % 256 != 0:
            raise ValueError(f"flash-attn 2 pages the KV cache in multiples of 256 tokens; "
                             f"kvcache_block_size is {k_cache.shape[1]} (use 256 or attention_backend='triton')")
        # flash-attn's window (left, right) counts the keys besides the query's own: (window - 1, 0)
        window_size = (window - 1, 0) if window else (-1, -1)
        if meta.is_decode:
            out = with_kvcache(q.unsqueeze(1), k_cache, v_cache, cache_seqlens=meta.seqlens_k,
                               block_table=meta.block_tables, softmax_scale=scale, causal=True,
                               window_size=window_size, softcap=softcap)
            return out.squeeze(1)
        cu_seqlens_k = F.pad(meta.seqlens_k.cumsum(0, dtype=torch.int32), (1, 0))
        return varlen(q, k_cache, v_cache, cu_seqlens_q=meta.cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                      max_seqlen_q=meta.max_seqlen_q, max_seqlen_k=meta.max_seqlen_k,
                      softmax_scale=scale, causal=True, block_table=meta.block_tables,
                      window_size=window_size, softcap=softcap)

    def _forward_fa4(self, q, k_cache, v_cache, meta, scale, window, softcap) -> torch.Tensor:
        (varlen,) = self._funcs
        # flash-attn 4 aligns the causal mask bottom-right per sequence, as the contract wants
        out = varlen(q, k_cache, v_cache, cu_seqlens_q=meta.cu_seqlens_q, seqused_k=meta.seqlens_k,
                     max_seqlen_q=meta.max_seqlen_q, max_seqlen_k=meta.max_seqlen_k,
                     page_table=meta.block_tables.clamp(min=0), softmax_scale=scale, causal=True,
                     window_size=(window - 1, 0) if window else (None, None), softcap=softcap)
        return out[0] if isinstance(out, tuple) else out
