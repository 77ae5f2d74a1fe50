"""The `triton` attention backend: the engine's own kernels (engine/kernels), default on CUDA."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engine.kernels import fused_decode, paged_decode, paged_prefill, qkv_prep, store_kvcache
from engine.kernels.paged_decode import decode_order

if TYPE_CHECKING:
    from engine.attention import AttentionMetadata


class TritonBackend:
    """Paged attention through Triton: split-KV decode, varlen chunked prefill, GQA-packed heads."""

    name = "triton"
    supports_cuda_graphs = True  # decode sizes its grid and scratch from Python ints only
    fuses_qkv_prep = True  # q/k norm, rotary and the K/V store in one kernel (qkv_prep)

    def __init__(self):
        # fused decode's split counters, zero between launches; earlier, smaller sets stay alive for the
        # CUDA graphs that captured them
        self._counters: list[torch.Tensor] = []

    def qkv_prep(self, qkv: torch.Tensor, positions: torch.Tensor, rotary, q_norm, k_norm,
                 k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                 num_heads: int, num_kv_heads: int, head_dim: int) -> torch.Tensor:
        """Queries [T, H, D] ready for attention; K/V stored. One kernel (engine/kernels/qkv_prep.py)."""
        q_weight, k_weight, eps, unit_offset = _qk_norm_args(q_norm, k_norm)
        return qkv_prep(qkv, positions, rotary.cos, rotary.sin, q_weight, k_weight, eps, k_cache, v_cache,
                        slot_mapping, num_heads, num_kv_heads, head_dim, unit_offset=unit_offset)

    def decode_from_qkv(self, qkv: torch.Tensor, positions: torch.Tensor, rotary, q_norm, k_norm,
                        k_cache: torch.Tensor, v_cache: torch.Tensor, meta: "AttentionMetadata",
                        num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                        after_gemv: bool | None = None, window: int = 0, softcap: float = 0.0,
                        sinks: torch.Tensor | None = None) -> torch.Tensor | None:
        """A decode batch's attention output [B, H, D] straight from the qkv rows, K/V stored: one kernel
        (engine/kernels/fused_decode.py); None where it does not apply (then qkv_prep and forward)."""
        if not (meta.is_decode and fused_decode.fits(head_dim)):
            return None
        q_weight, k_weight, eps, unit_offset = _qk_norm_args(q_norm, k_norm)
        return fused_decode.fused_decode(
            qkv, positions, rotary.cos, rotary.sin, q_weight, k_weight, eps, k_cache, v_cache,
            meta.slot_mapping, meta.seqlens_k, meta.block_tables, meta.max_seqlen_k, scale, num_heads,
            num_kv_heads, self._split_counters(qkv.shape[0] * num_kv_heads, qkv.device),
            order=self._decode_order(meta), after_gemv=after_gemv, window=window, softcap=softcap,
            unit_offset=unit_offset, sinks=sinks)

    def _split_counters(self, count: int, device: torch.device) -> torch.Tensor:
        if not self._counters or self._counters[-1].numel() < count or self._counters[-1].device != device:
            self._counters.append(torch.zeros(max(count, 1024), dtype=torch.int32, device=device))
        return self._counters[-1]

    def store_kvcache(self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        store_kvcache(key, value, k_cache, v_cache, slot_mapping)

    def prepare(self, meta: "AttentionMetadata") -> None:
        """Before a forward pass's first kernel: sort the decode order now. The fused decode kernel reads it
        before its wait where the GEMV precedes it, so no kernel just before it may write the order."""
        self._decode_order(meta)

    def _decode_order(self, meta: "AttentionMetadata") -> torch.Tensor | None:
        """The batch's sequences longest first, sorted on the device once a forward pass (by prepare, or
        the first layer; inside a CUDA graph being captured, the sort is captured with it) and kept for
        the others."""
        if meta.decode_order is None and meta.seqlens_k.shape[0] > 1 and meta.has_decode_rows:
            meta.decode_order = decode_order(meta.seqlens_k)
        return meta.decode_order

    def forward(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: "AttentionMetadata", scale: float, window: int = 0, softcap: float = 0.0,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        if meta.is_decode:
            return paged_decode(q, k_cache, v_cache, meta.seqlens_k, meta.block_tables, meta.max_seqlen_k, scale,
                                order=self._decode_order(meta), window=window, softcap=softcap, sinks=sinks)
        # chunks through the prefill kernel; one-token rows of a mixed batch through split-KV decode
        out = paged_prefill(q, k_cache, v_cache, meta.cu_seqlens_q, meta.seqlens_k,
                            meta.block_tables, meta.max_seqlen_q, scale, skip_decodes=True, window=window,
                            softcap=softcap, sinks=sinks)
        if not meta.has_decode_rows:  # a prefill-only step: no decode launches (their host time is the cost)
            return out
        return paged_decode(q, k_cache, v_cache, meta.seqlens_k, meta.block_tables, meta.max_seqlen_k,
                            scale, out=out, cu_seqlens_q=meta.cu_seqlens_q, order=self._decode_order(meta),
                            window=window, softcap=softcap, sinks=sinks)


def _qk_norm_args(q_norm, k_norm) -> tuple:
    """(q norm weight, k norm weight, eps, scaled by 1 + weight) for the fused kernels: (None, None, 0.0, False)
    without q/k norm."""
    if q_norm is None:
        return None, None, 0.0, False
    if q_norm.eps != k_norm.eps or q_norm.unit_offset != k_norm.unit_offset:
        raise ValueError("the fused q/k norm needs one eps and one kind of norm for both")
    return q_norm.weight, k_norm.weight, q_norm.eps, q_norm.unit_offset
