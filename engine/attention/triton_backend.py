"""The `triton` attention backend: the engine's own kernels (engine/kernels), default on CUDA."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engine.kernels import paged_decode, paged_prefill, store_kvcache

if TYPE_CHECKING:
    from engine.attention import AttentionMetadata


class TritonBackend:
    """Paged attention through Triton: split-KV decode, varlen chunked prefill, GQA-packed heads."""

    name = "triton"
    supports_cuda_graphs = True  # decode sizes its split scratch from Python ints only

    def store_kvcache(self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        store_kvcache(key, value, k_cache, v_cache, slot_mapping)

    def forward(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: "AttentionMetadata", scale: float) -> torch.Tensor:
        if meta.is_decode:
            return paged_decode(q, k_cache, v_cache, meta.seqlens_k, meta.block_tables,
                                meta.max_seqlen_k, scale)
        # chunks through the prefill kernel; one-token rows of a mixed batch through split-KV decode
        out = paged_prefill(q, k_cache, v_cache, meta.cu_seqlens_q, meta.seqlens_k,
                            meta.block_tables, meta.max_seqlen_q, scale, skip_decodes=True)
        return paged_decode(q, k_cache, v_cache, meta.seqlens_k, meta.block_tables, meta.max_seqlen_k,
                            scale, out=out, cu_seqlens_q=meta.cu_seqlens_q)
