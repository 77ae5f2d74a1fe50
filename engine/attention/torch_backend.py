"""Reference attention in plain torch: any device, one sequence at a time. Not capturable in CUDA graphs."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.attention import AttentionMetadata


def to_cache(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x as a KV cache of `dtype` holds it: the model's dtype as is; fp8 rounded to nearest even and
    saturated at its largest finite value (torch's own cast gives NaN from 480 up on CUDA), as the
    Triton kernels store it."""
    if dtype == torch.float8_e4m3fn:
        limit = torch.finfo(dtype).max
        x = x.clamp(-limit, limit)
    return x.to(dtype)


class TorchBackend:
    name = "torch"
    supports_cuda_graphs = False

    def store_kvcache(self, key, value, k_cache, v_cache, slot_mapping) -> None:
        valid = slot_mapping >= 0
        slots = slot_mapping[valid].long()
        # (index assignment: index_copy_ has no fp8 kernel on CPU; the slots are distinct)
        k_cache.view(-1, *k_cache.shape[2:])[slots] = to_cache(key[valid], k_cache.dtype)
        v_cache.view(-1, *v_cache.shape[2:])[slots] = to_cache(value[valid], v_cache.dtype)

    def forward(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float, window: int = 0, softcap: float = 0.0,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        out = torch.empty_like(q)
        block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
        group = q.shape[1] // num_kv_heads
        cu_q = meta.cu_seqlens_q.tolist()
        lens_k = meta.seqlens_k.tolist()
        for b, len_k in enumerate(lens_k):
            start, end = cu_q[b], cu_q[b + 1]
            len_q = end - start
            num_blocks = (len_k + block_size - 1) // block_size
            blocks = meta.block_tables[b, :num_blocks].long()
            k = k_cache[blocks].flatten(0, 1)[:len_k].to(q.dtype).repeat_interleave(group, dim=1)
            v = v_cache[blocks].flatten(0, 1)[:len_k].to(q.dtype).repeat_interleave(group, dim=1)
            q_pos = torch.arange(len_k - len_q, len_k, device=q.device)[:, None]
            k_pos = torch.arange(len_k, device=q.device)[None, :]
            mask = q_pos >= k_pos
            if window:  # a query at position i sees keys j with i - j < window
                mask &= q_pos - k_pos < window
            o = attend(q[start:end].transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), mask, scale, softcap,
                       sinks)
            out[start:end] = o.transpose(0, 1)
        return out


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
           softcap: float = 0.0, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of q [H, Lq, D] over k, v [H, Lk, D] where mask [Lq, Lk] is True; with softcap, each logit
    becomes cap x tanh(logit / cap) before the mask and softmax (as transformers' eager Gemma 2); sinks [H]:
    each head's logit joins its softmax as one more column that carries no value (as transformers' gpt-oss)."""
    if not softcap and sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        return torch.matmul(scores.softmax(dim=-1, dtype=torch.float32).to(q.dtype), v)
    sink_column = sinks.to(scores.dtype)[:, None, None].expand(-1, scores.shape[1], 1)
    probs = torch.cat([scores, sink_column], dim=-1).softmax(dim=-1, dtype=torch.float32)[..., :-1]
    return torch.matmul(probs.to(q.dtype), v)
