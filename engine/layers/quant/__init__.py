"""Quantized checkpoints: a config.json's `quantization_config` parsed into a QuantMethod, which the linear
layers (engine/layers/linear.py) hold their weights by.

A QuantMethod says which linears its checkpoint quantizes (`quantizes`), registers on each such layer the
checkpoint's own tensors in their own dtype and shape, this rank's slice of them (`create_weights`: each
parameter carries the loaders of engine/layers/linear.py, `weight_loader(param, tensor, shard_id)` and
`load_full(param, tensor)`), prepares them once loaded (`after_loading`) and computes the layer's product
(`apply`): on CPU by dequantizing the weight to the activations' dtype on the fly, on CUDA in the format's kernel.
A method that quantizes a mixture of experts' experts (`quantizes_experts`: MXFP4) registers their packed tensors
on each ExpertWeights (`create_experts`, engine/layers/moe.py), whose fused kernels read them.

Methods by `quant_method`: METHODS; compressed-tensors checkpoints choose their scheme by their `format`
(COMPRESSED_TENSORS_FORMATS). Any other method or format is refused in one line naming it.
"""
from __future__ import annotations

import importlib
import re

import torch
from torch import nn

# quant_method → "module:class" under engine.layers.quant; the class is built from the quantization_config
METHODS = {
    "fp8": "fp8:Fp8Method",
    "awq": "int4:AwqMethod",
    "gptq": "int4:GptqMethod",
    "mxfp4": "mxfp4:Mxfp4Method",
}
# compressed-tensors `format` → "module:class", built from the quantization_config and its one config group
COMPRESSED_TENSORS_FORMATS = {
    "float-quantized": "fp8:CompressedTensorsFp8Method",
    "pack-quantized": "int4:CompressedTensorsInt4Method",
}


class QuantMethod:
    """One checkpoint's quantization. Subclasses set `name` and implement create_weights and apply."""

    name = "?"
    quantizes_experts = False  # whether its MoE experts are quantized (create_experts registers them: MXFP4)

    def __init__(self, config: dict):
        self.config = config
        self.not_converted: list[str] = []  # module names (or "re:" patterns) the checkpoint keeps in float

    def quantizes(self, checkpoint_names: list[str]) -> bool:
        """Whether the linear layer whose checkpoint modules are `checkpoint_names` (several for a packed
        projection: q_proj, k_proj, v_proj) is quantized. Parts of one packed projection must agree."""
        kept = [any(_matches(name, pattern) for pattern in self.not_converted) for name in checkpoint_names]
        if any(kept) and not all(kept):
            raise ValueError(f"the {self.name} checkpoint quantizes some of {', '.join(checkpoint_names)} and not "
                             "others; the engine runs them as one projection: quantize all or none")
        return not kept[0]

    def create_weights(self, layer: nn.Module) -> None:
        raise NotImplementedError

    def after_loading(self, layer: nn.Module) -> None:
        """Once every tensor is loaded (or made up, for dummy weights): derived tensors, layouts for kernels."""

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError


def _matches(name: str, pattern: str) -> bool:
    """compressed-tensors' `ignore` and transformers' `modules_to_not_convert` entries: a module name, a name's
    last components ("lm_head", "mlp.gate"), a prefix of names, or "re:<regex>" matched from the start."""
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    return name == pattern or name.endswith("." + pattern) or name.startswith(pattern + ".")


def single_config_group(config: dict) -> tuple[dict, dict | None]:
    """(weights, input_activations) of a compressed-tensors config's one scheme for its linear layers: config
    groups that target them must all be alike."""
    groups = [g for g in (config.get("config_groups") or {}).values() if isinstance(g, dict)]
    if not groups:
        raise ValueError("the compressed-tensors quantization_config has no config_groups")
    schemes = {repr((g.get("weights"), g.get("input_activations"))) for g in groups}
    if len(schemes) > 1:
        raise ValueError(f"the compressed-tensors checkpoint mixes {len(schemes)} schemes across its config groups; "
                         "supported: one scheme for every quantized linear layer")
    if not isinstance(groups[0].get("weights"), dict):
        raise ValueError("the compressed-tensors config group quantizes no weights; supported: quantized weights")
    return groups[0]["weights"], groups[0].get("input_activations")


def _build(spec: str, *args) -> QuantMethod:
    module, cls = spec.split(":")
    return getattr(importlib.import_module(f"engine.layers.quant.{module}"), cls)(*args)


def parse_quantization(raw_config: dict) -> QuantMethod | None:
    """The QuantMethod of a config.json (its parsed dict), None where the checkpoint is not quantized; ValueError
    in one line for a method or variant the engine does not run."""
    quant = raw_config.get("quantization_config")
    if quant is None:
        return None
    method = quant.get("quant_method") if isinstance(quant, dict) else None
    if not method and isinstance(quant, dict) and (quant.get("load_in_4bit") or quant.get("load_in_8bit")):
        method = "bitsandbytes"
    method = str(method or "unknown method")[:40]
    supported = ", ".join([*METHODS, "compressed-tensors"])
    if method == "compressed-tensors":
        fmt = str(quant.get("format"))[:40]
        if fmt not in COMPRESSED_TENSORS_FORMATS:
            raise ValueError(f"the checkpoint is quantized (compressed-tensors, format {fmt}); supported "
                             f"compressed-tensors formats: {', '.join(COMPRESSED_TENSORS_FORMATS)}")
        return _build(COMPRESSED_TENSORS_FORMATS[fmt], quant)
    if method not in METHODS:
        raise ValueError(f"the checkpoint is quantized ({method}), a method this engine does not run; "
                         f"supported: {supported}; or use the model's float (bf16/fp16) checkpoint")
    return _build(METHODS[method], quant)


def quantize_linears(model: nn.Module, method: QuantMethod) -> None:
    """Every linear layer of `model` the checkpoint quantizes takes `method`'s weights in place of its float
    weight (before loading). A layer's checkpoint names undo the model's packing (qkv_proj → q_proj, k_proj,
    v_proj) and renaming (its `checkpoint_prefixes`)."""
    from engine.layers.linear import _Linear
    unpacked: dict[str, list[str]] = {}
    for ckpt_part, (param_part, _) in getattr(model, "packed_modules", {}).items():
        unpacked.setdefault(param_part, []).append(ckpt_part)
    prefixes = {ours: theirs for theirs, ours in getattr(model, "checkpoint_prefixes", {}).items()}
    from engine.layers.moe import ExpertWeights
    for name, module in model.named_modules():
        if isinstance(module, ExpertWeights) and method.quantizes_experts:
            module.quantize(method)
        if not isinstance(module, _Linear):
            continue
        for ours, theirs in prefixes.items():
            if name.startswith(ours):
                name = theirs + name[len(ours):]
                break
        parent, _, leaf = name.rpartition(".")
        names = [f"{parent}.{part}" if parent else part for part in unpacked.get(leaf, [leaf])]
        if method.quantizes(names):
            module.quantize(method)


def after_loading(model: nn.Module) -> None:
    for module in model.modules():
        if getattr(module, "quant", None) is not None:
            module.quant.after_loading(module)
