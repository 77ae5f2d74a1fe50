"""Gemma 2 (Gemma Team, 2024): a pre- and post-norm decoder of local and global attention layers.

    h = embed(x) * sqrt(d)                                    (the scale rounded to the model's dtype)
    h = h + post_attention_norm(attention(input_norm(h)))
    h = h + post_feedforward_norm(GeGLU(pre_feedforward_norm(h)))
    logits = c_f * tanh(lm_head(norm(h)) / c_f)

- Every RMSNorm scales by (1 + weight) (GemmaRMSNorm).
- Attention (rotary, GQA) scales its logits by query_pre_attn_scalar^-1/2 and soft-caps them,
  c_a * tanh(logit / c_a); the layers config.layer_types marks "sliding_attention" (every other one, from the
  first) see only the last sliding_window positions, the others the whole context.
- The MLP is GeGLU: down(gelu_tanh(gate(x)) * up(x)).

The residual stream is carried as in the Llama decoder, (branch output, residual), so that each pre-norm adds
the residual and normalises in one step (fused into the projection after it for decode batches). Under tensor
parallelism the attention's and the MLP's outputs are summed over ranks before their post-norms.
"""
from __future__ import annotations

import torch
from torch import nn

from engine.attention import ForwardContext
from engine.layers.attention import Attention, layer_type_windows
from engine.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from engine.layers.fusion import takes_gemv
from engine.layers.linear import QKVParallelLinear, RowParallelLinear
from engine.layers.mlp import GatedMLP
from engine.layers.norm import GemmaRMSNorm
from engine.layers.parallel import TPGroup, divide
from engine.layers.rotary import RotaryEmbedding, rope_settings


class Gemma2Attention(nn.Module):
    def __init__(self, cfg, tp: TPGroup, ctx: ForwardContext, rotary: RotaryEmbedding, window: int):
        super().__init__()
        self.head_dim = cfg.head_dim
        num_heads = divide(cfg.num_attention_heads, tp.size, "num_attention_heads")
        num_kv_heads = divide(cfg.num_key_value_heads, tp.size, "num_key_value_heads")
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, self.head_dim, cfg.num_attention_heads,
                                          cfg.num_key_value_heads, bias=cfg.attention_bias, tp=tp)
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * self.head_dim, cfg.hidden_size,
                                        bias=cfg.attention_bias, tp=tp)
        self.rotary_emb = rotary
        self.attn = Attention(num_heads, num_kv_heads, self.head_dim, cfg.query_pre_attn_scalar ** -0.5, ctx,
                              window=window, softcap=cfg.attn_logit_softcapping or 0.0)

    def qk_norms(self) -> tuple[nn.Module | None, nn.Module | None]:
        return None, None

    def forward(self, positions: torch.Tensor, qkv: torch.Tensor) -> torch.Tensor:
        """Attention over the packed q/k/v rows (qkv_proj's output, computed with the input norm), then the
        output projection, summed over ranks."""
        after_gemv = takes_gemv(qkv, self.qkv_proj.weight)  # the decode kernel can then start before it ends
        return self.o_proj(self.attn(qkv, positions, self.rotary_emb, *self.qk_norms(), after_gemv))


class GemmaDecoderLayer(nn.Module):
    def __init__(self, cfg, attention: nn.Module, tp: TPGroup):
        super().__init__()
        self.self_attn = attention
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_activation, tp, reduce_results=True)
        self.input_layernorm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None):
        """(x, residual) in, the stream h = x + residual (h = x in the first layer); (post-normed MLP output,
        h after attention) out, whose sum the next layer's input norm takes."""
        qkv, residual = self.input_layernorm.linear(x, residual, self.self_attn.qkv_proj)
        x = self.post_attention_layernorm(self.self_attn(positions, qkv))
        gate_up, residual = self.pre_feedforward_layernorm.linear(x, residual, self.mlp.gate_up_proj)
        return self.post_feedforward_layernorm(self.mlp(gate_up)), residual


class Gemma2Model(nn.Module):
    def __init__(self, cfg, tp: TPGroup, ctx: ForwardContext):
        super().__init__()
        check_gemma_config(cfg)
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp, scale=cfg.hidden_size ** 0.5)
        self.build_rotary(cfg)
        self.layers = nn.ModuleList(GemmaDecoderLayer(cfg, self.attention(cfg, tp, ctx, layer_type, window), tp)
                                    for layer_type, window in zip(cfg.layer_types, layer_type_windows(cfg)))
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.ctx = ctx

    def build_rotary(self, cfg) -> None:
        self.rotary_emb = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, *rope_settings(cfg))

    def attention(self, cfg, tp: TPGroup, ctx: ForwardContext, layer_type: str, window: int) -> nn.Module:
        return Gemma2Attention(cfg, tp, ctx, self.rotary_emb, window)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        self.ctx.prepare()  # what every layer's attention reads, first
        x, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            x, residual = layer(positions, x, residual)
        x, _ = self.norm(x, residual)
        return x


def check_gemma_config(cfg) -> None:
    if getattr(cfg, "use_bidirectional_attention", False):
        raise ValueError("use_bidirectional_attention=True (an embedding model's attention) is not supported")


class Gemma2ForCausalLM(nn.Module):
    model_class = Gemma2Model
    # checkpoint name → (our packed parameter, which part of it)
    packed_modules = {
        "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, cfg, tp: TPGroup, ctx: ForwardContext):
        super().__init__()
        self.model = self.model_class(cfg, tp, ctx)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, tp, softcap=cfg.final_logit_softcapping)
        self.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", True))
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @classmethod
    def layer_windows(cls, cfg) -> list[int]:
        """Each layer's sliding window, 0 for the whole context."""
        return layer_type_windows(cfg)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)
