"""Mixtral (Jiang et al., 2024): the Mistral decoder with a sparse mixture of experts in every layer.

Each layer's MLP is num_local_experts SwiGLU experts (config.intermediate_size each); a router sends each token
to its num_experts_per_tok (2) most probable experts, weighted by a softmax over those experts' logits
(engine/layers/moe.py). Every layer attends through config.sliding_window where it is set (null in Mixtral
8x7B's and 8x22B's configs: the whole context).

The checkpoint names the block block_sparse_moe and each expert's projections w1 (gate), w3 (up), w2 (down).
"""
from __future__ import annotations

from torch import nn

from engine.layers.attention import every_layer_window
from engine.layers.moe import FusedMoE, expert_checkpoint_target
from engine.layers.parallel import TPGroup
from engine.models.llama import FamilyFlags, LlamaForCausalLM


class MixtralFlags(FamilyFlags):
    layer_windows = staticmethod(every_layer_window)

    @staticmethod
    def layer_mlp(cfg, tp: TPGroup, layer_index: int) -> nn.Module:
        if getattr(cfg, "hidden_act", "silu") not in ("silu", "swish"):
            raise ValueError(f"hidden activation {cfg.hidden_act!r} is not supported for experts; supported: silu")
        return FusedMoE(cfg.hidden_size, cfg.intermediate_size, cfg.num_local_experts, cfg.num_experts_per_tok, tp,
                        renormalize=True)


class MixtralForCausalLM(LlamaForCausalLM):
    flags = MixtralFlags

    def checkpoint_target(self, name: str):
        """block_sparse_moe.experts.{e}.w1/w3/w2 → the layer's stacked experts; block_sparse_moe.gate → mlp.gate."""
        target = expert_checkpoint_target(name)
        if target is None and ".block_sparse_moe." in name:
            return name.replace(".block_sparse_moe.", ".mlp."), None
        return target
