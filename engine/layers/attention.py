import torch
from torch import nn

from engine.attention import ForwardContext


class Attention(nn.Module):
    """From the packed qkv projection: heads, q/k norm, rotary, K/V into the paged cache, attention.

    window: a sliding window (a query at position i sees keys j with i - j < window), 0 for none; softcap:
    attention-logit soft-capping (each logit cap x tanh(logit / cap)), 0 for none. Both go to the backend's
    kernels, as do attention sinks, which forward takes from the model's attention (their owner)."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, ctx: ForwardContext,
                 window: int = 0, softcap: float = 0.0):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        self.window, self.softcap = window, softcap
        self.ctx = ctx
        self.k_cache = self.v_cache = torch.tensor([])  # set by the model runner

    def forward(self, qkv: torch.Tensor, positions: torch.Tensor, rotary: nn.Module,
                q_norm: nn.Module | None = None, k_norm: nn.Module | None = None,
                after_gemv: bool | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """after_gemv: whether the qkv projection ran in the GEMV (None: not known); sinks: [num_heads] attention
        sinks (gpt-oss: each head's learned logit joins its softmax's denominator and carries no value)."""
        meta, backend = self.ctx.meta, self.ctx.backend
        if hasattr(backend, "decode_from_qkv"):  # decode: one kernel from the qkv rows, where it applies
            out = backend.decode_from_qkv(qkv, positions, rotary, q_norm, k_norm, self.k_cache, self.v_cache, meta,
                                          self.num_heads, self.num_kv_heads, self.head_dim, self.scale,
                                          after_gemv=after_gemv, window=self.window, softcap=self.softcap,
                                          sinks=sinks)
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
        out = backend.forward(q, self.k_cache, self.v_cache, meta, self.scale, window=self.window,
                              softcap=self.softcap, sinks=sinks)
        return out.flatten(1)


def layer_type_windows(cfg) -> list[int]:
    """Each layer's sliding window where config.layer_types marks it "sliding_attention" (Qwen2/Qwen3 with
    use_sliding_window, Gemma 2 and 3): config.sliding_window; 0 (the whole context) for the others."""
    layer_types = getattr(cfg, "layer_types", None) or ["full_attention"] * cfg.num_hidden_layers
    for kind in set(layer_types) - {"full_attention", "sliding_attention"}:
        raise ValueError(f"layer type {kind!r} is not supported; supported: full_attention, sliding_attention")
    return [_window(cfg) if kind == "sliding_attention" else 0 for kind in layer_types]


def every_layer_window(cfg) -> list[int]:
    """config.sliding_window for every layer (Mistral, Phi-3), or 0 (the whole context) where it is null."""
    window = _window(cfg) if getattr(cfg, "sliding_window", None) is not None else 0
    return [window] * cfg.num_hidden_layers


def _window(cfg) -> int:
    window = getattr(cfg, "sliding_window", None)
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"sliding_window must be a positive integer for sliding-window layers, got {window!r}")
    return window
