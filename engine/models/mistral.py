"""Mistral (Jiang et al., 2023): the Llama decoder with sliding-window attention on every layer.

Each layer attends to the last config.sliding_window positions (a query at position i sees keys j with
i - j < window); a null sliding_window (Mistral 7B v0.2 on) attends to the whole context, as Llama does.
"""
from engine.layers.attention import every_layer_window
from engine.models.llama import FamilyFlags, LlamaForCausalLM


class MistralFlags(FamilyFlags):
    layer_windows = staticmethod(every_layer_window)


class MistralForCausalLM(LlamaForCausalLM):
    flags = MistralFlags
