import torch
from torch import nn

from engine.attention import ForwardContext


class Attention(nn.Module):
    """From the packed qkv projection: heads, q/k norm, rotary, K/V into the paged cache, attention."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, ctx: ForwardContext):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        self.ctx = ctx
        self.k_cache = self.v_cache = torch.tensor([])  # set by the model runner

    def forward(self, qkv: torch.Tensor, positions: torch.Tensor, rotary: nn.Module,
                q_norm: nn.Module | None = None, k_norm: nn.Module | None = None,
                after_gemv: bool | None = None) -> torch.Tensor:
        """after_gemv: whether the qkv projection ran in the GEMV (None: not known)."""
        meta, backend = self.ctx.meta, self.ctx.backend
        if hasattr(backend, "decode_from_qkv"):  # decode: one kernel from the qkv rows, where it applies
            out = backend.decode_from_qkv(qkv, positions, rotary, q_norm, k_norm, self.k_cache, self.v_cache, meta,
                                          self.num_heads, self.num_kv_heads, self.head_dim, self.scale,
                                          after_gemv=after_gemv)
            if out is not None:
                return out.flatten(1)
        if getattr(backend, "fuses_qkv_prep", False):  # one kernel instead of about seven
            q = backend.qkv_prep(qkv, positions, rotary, q_norm, k_norm, self.k_cache, self.v_cache,
                                 meta.slot_mapping, self.num_heads, self.num_kv_heads, self.head_dim)
        else:
            q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
            q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
            q = q.view(-1, self.num_heads, self.head_dim)
            k = k.view(-1, self.num_kv_heads, self.head_dim)
            v = v.view(-1, self.num_kv_heads, self.head_dim)
            if q_norm is not None:
                q, k = q_norm(q), k_norm(k)
            q, k = rotary(positions, q, k)
            backend.store_kvcache(k, v, self.k_cache, self.v_cache, meta.slot_mapping)
        out = backend.forward(q, self.k_cache, self.v_cache, meta, self.scale)
        return out.flatten(1)
