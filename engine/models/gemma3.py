"""Gemma 3 (Gemma Team, 2025), the text decoder (Gemma3ForCausalLM): Gemma 2's layers with

- per-head q/k RMSNorm (scaling by 1 + weight) before the rotary embedding, in place of soft-capping (the
  caps are honoured where a config sets them; Gemma 3's do not);
- local and global layers in config.layer_types' pattern (five local to one global), the local ones on
  their own rope (rope_parameters["sliding_attention"]: theta 10,000), the global ones on theirs
  (rope_parameters["full_attention"]: theta 1,000,000, linearly scaled in the larger models).
"""
from __future__ import annotations

from torch import nn

from engine.attention import ForwardContext
from engine.layers.norm import GemmaRMSNorm
from engine.layers.parallel import TPGroup
from engine.layers.rotary import RotaryEmbedding, rope_settings
from engine.models.gemma2 import Gemma2Attention, Gemma2ForCausalLM, Gemma2Model


class Gemma3Attention(Gemma2Attention):
    def __init__(self, cfg, tp: TPGroup, ctx: ForwardContext, rotary: RotaryEmbedding, window: int):
        super().__init__(cfg, tp, ctx, rotary, window)
        self.q_norm = GemmaRMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(self.head_dim, cfg.rms_norm_eps)

    def qk_norms(self) -> tuple[nn.Module, nn.Module]:
        return self.q_norm, self.k_norm


class Gemma3Model(Gemma2Model):
    def build_rotary(self, cfg) -> None:
        max_position = cfg.max_position_embeddings
        self.rotary_emb = RotaryEmbedding(cfg.head_dim, max_position, *rope_settings(cfg, "full_attention"))
        self.rotary_emb_local = RotaryEmbedding(cfg.head_dim, max_position, *rope_settings(cfg, "sliding_attention"))

    def attention(self, cfg, tp: TPGroup, ctx: ForwardContext, layer_type: str, window: int) -> nn.Module:
        rotary = self.rotary_emb_local if layer_type == "sliding_attention" else self.rotary_emb
        return Gemma3Attention(cfg, tp, ctx, rotary, window)


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    model_class = Gemma3Model
