"""Qwen3-MoE and Qwen2-MoE (Qwen Team, 2024-2025): the Qwen3 and Qwen2 decoders with mixture-of-experts MLPs.

- Layer i takes a sparse block where i is not in config.mlp_only_layers and (i + 1) % decoder_sparse_step == 0
  (every layer, in the published checkpoints); the others a dense SwiGLU MLP of config.intermediate_size.
- The sparse block (engine/layers/moe.py): num_experts experts of moe_intermediate_size, each token routed to
  its num_experts_per_tok most probable ones, their softmax weights renormalised to sum to one where
  norm_topk_prob (Qwen3-MoE's checkpoints; Qwen2-MoE's leave them as they are).
- Qwen2-MoE adds a shared expert every token takes (shared_expert_intermediate_size), scaled by
  sigmoid(shared_expert_gate(x)), and q/k/v biases. Qwen3-MoE has per-head q/k RMSNorm.
- Sliding windows: Qwen2-MoE's config.layer_types marks its sliding layers; Qwen3-MoE slides every layer where
  sliding_window is set (use_sliding_window).
"""
from __future__ import annotations

from torch import nn

from engine.layers.attention import every_layer_window
from engine.layers.mlp import GatedMLP
from engine.layers.moe import FusedMoE, SharedExpertMoE, expert_checkpoint_target
from engine.layers.parallel import TPGroup
from engine.models.llama import LlamaForCausalLM
from engine.models.qwen import Qwen2Flags, Qwen3Flags


def is_sparse_layer(cfg, layer_index: int) -> bool:
    return (cfg.num_experts > 0 and layer_index not in (cfg.mlp_only_layers or [])
            and (layer_index + 1) % cfg.decoder_sparse_step == 0)


def qwen_moe(cfg, tp: TPGroup) -> FusedMoE:
    if getattr(cfg, "hidden_act", "silu") not in ("silu", "swish"):
        raise ValueError(f"hidden activation {cfg.hidden_act!r} is not supported for experts; supported: silu")
    return FusedMoE(cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts, cfg.num_experts_per_tok, tp,
                    renormalize=bool(cfg.norm_topk_prob))


class Qwen3MoeFlags(Qwen3Flags):
    layer_windows = staticmethod(every_layer_window)

    @staticmethod
    def layer_mlp(cfg, tp: TPGroup, layer_index: int) -> nn.Module:
        if is_sparse_layer(cfg, layer_index):
            return qwen_moe(cfg, tp)
        return GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act, tp)


class Qwen2MoeFlags(Qwen2Flags):
    @staticmethod
    def layer_mlp(cfg, tp: TPGroup, layer_index: int) -> nn.Module:
        if is_sparse_layer(cfg, layer_index):
            return SharedExpertMoE(qwen_moe(cfg, tp), cfg.hidden_size, cfg.shared_expert_intermediate_size, tp)
        return GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act, tp)


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    flags = Qwen3MoeFlags

    def checkpoint_target(self, name: str):
        """One expert's tensor (mlp.experts.{e}.gate_proj...) → the layer's stacked experts."""
        return expert_checkpoint_target(name)


class Qwen2MoeForCausalLM(LlamaForCausalLM):
    flags = Qwen2MoeFlags

    def __init__(self, cfg, tp: TPGroup, ctx):
        if not getattr(cfg, "qkv_bias", True):
            raise ValueError("Qwen2-MoE with qkv_bias=False is not supported")
        super().__init__(cfg, tp, ctx)

    def checkpoint_target(self, name: str):
        """One routed expert's tensor → mlp.moe.experts; the router mlp.gate → mlp.moe.gate."""
        target = expert_checkpoint_target(name, block="mlp.moe")
        if target is None and name.endswith(".mlp.gate.weight"):
            return name.replace(".mlp.gate.weight", ".mlp.moe.gate.weight"), None
        return target
