import torch
from torch import nn

from engine.attention import ForwardContext


class Attention(nn.Module):
    """Stores this step's K/V in the layer's paged cache, then attends over the cache."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, ctx: ForwardContext):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        self.ctx = ctx
        self.k_cache = self.v_cache = torch.tensor([])  # set by the model runner

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        meta = self.ctx.meta
        backend = self.ctx.backend
        backend.store_kvcache(k, v, self.k_cache, self.v_cache, meta.slot_mapping)
        out = backend.forward(q, self.k_cache, self.v_cache, meta, self.scale)
        return out.flatten(1)
