"""PEFT LoRA adapters read from disk into host memory, checked once.

save_pretrained writes adapter_config.json (r, lora_alpha, target_modules, use_rslora, ...) and
adapter_model.safetensors with base_model.model.<module>.lora_A.weight [r, in] and .lora_B.weight [out, r]. A
layer's output gains x @ A^T @ B^T * scale, scale = lora_alpha / r (use_rslora: lora_alpha / sqrt(r)); the
scale is folded into B here."""
from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass

import torch

# checkpoint projections an adapter may target (the decoder layers' attention and MLP projections)
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_TENSOR = re.compile(r"^base_model\.model\.(.+)\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)"
                     r"\.lora_([AB])(?:\.[^.]+)?\.weight$")


@dataclass
class LoRAPart:
    """One checkpoint projection's adapter: its part of a (possibly packed) engine projection."""
    part: int
    a: torch.Tensor  # [r, in], float32
    b: torch.Tensor  # [out, r], float32, times the adapter's scale


@dataclass
class Adapter:
    name: str
    path: str
    rank: int
    modules: dict[str, list[LoRAPart]]  # engine projection name (model.layers.0.self_attn.qkv_proj) → its parts


def read_adapter_config(path: str, max_rank: int) -> dict:
    """adapter_config.json of a PEFT LoRA adapter, checked against what the engine applies (ValueError in one
    line otherwise)."""
    config_file = os.path.join(path, "adapter_config.json")
    if not os.path.isfile(config_file) or not os.path.isfile(os.path.join(path, "adapter_model.safetensors")):
        raise ValueError(f"LoRA adapter path {path!r} has no adapter_config.json and adapter_model.safetensors "
                         "(a PEFT save_pretrained directory)")
    with open(config_file) as f:
        cfg = json.load(f)
    if cfg.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"adapter {path!r} is a {cfg.get('peft_type')} adapter; only LORA adapters are supported")
    rank = cfg.get("r")
    if not isinstance(rank, int) or rank < 1:
        raise ValueError(f"adapter {path!r} has rank r={rank!r}; it must be a positive integer")
    if rank > max_rank:
        raise ValueError(f"adapter {path!r} has rank {rank}; max_lora_rank is {max_rank}: start the engine with "
                         f"max_lora_rank >= {rank}")
    if cfg.get("bias", "none") != "none":
        raise ValueError(f"adapter {path!r} has bias={cfg['bias']!r}; only bias='none' is supported")
    for key in ("use_dora", "modules_to_save", "rank_pattern", "alpha_pattern", "layers_to_transform"):
        if cfg.get(key):
            raise ValueError(f"adapter {path!r} sets {key}; adapters with {key} are not supported")
    targets = cfg.get("target_modules") or []
    targets = [targets] if isinstance(targets, str) else list(targets)
    unknown = sorted(set(targets) - set(TARGET_MODULES))
    if unknown:
        raise ValueError(f"adapter {path!r} targets {', '.join(unknown)}; supported target modules: "
                         f"{', '.join(TARGET_MODULES)}")
    return cfg


def load_adapter(name: str, path: str, max_rank: int, packed_modules: dict) -> Adapter:
    """The adapter at `path`, its tensors in host memory as the engine's projections take them. packed_modules:
    the model's checkpoint name → (engine projection, part) map (LlamaForCausalLM.packed_modules)."""
    from safetensors.torch import load_file

    cfg = read_adapter_config(path, max_rank)
    rank = cfg["r"]
    alpha = cfg.get("lora_alpha", rank)
    scale = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
    try:
        tensors = load_file(os.path.join(path, "adapter_model.safetensors"))
    except Exception as e:  # noqa: BLE001 - safetensors' own error (a broken or truncated file), or the OS's
        raise ValueError(f"adapter {path!r}: adapter_model.safetensors cannot be read ({type(e).__name__}: "
                         f"{str(e).splitlines()[0] if str(e) else 'no detail'})") from None
    pairs: dict[tuple[str, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _TENSOR.match(key)
        if match is None:
            raise ValueError(f"adapter {path!r} holds tensor {key!r}, which is no LoRA A/B of a supported module")
        prefix, module, which = match.groups()
        pairs.setdefault((prefix, module), {})[which] = tensor.float()
    modules: dict[str, list[LoRAPart]] = {}
    for (prefix, module), ab in pairs.items():
        if set(ab) != {"A", "B"}:
            raise ValueError(f"adapter {path!r} has lora_A or lora_B of {prefix}.{module} alone")
        a, b = ab["A"], ab["B"]
        if cfg.get("fan_in_fan_out"):  # weights stored [in, out] (GPT-2's Conv1D layout)
            a, b = a.T, b.T
        if a.shape[0] != rank or b.shape[1] != rank:
            raise ValueError(f"adapter {path!r}: {prefix}.{module} has rank {a.shape[0]}, config r={rank}")
        target, part = packed_modules.get(module, (module, 0))
        modules.setdefault(f"{prefix}.{target}", []).append(LoRAPart(part, a.contiguous(), (b * scale).contiguous()))
    return Adapter(name, path, rank, modules)


def check_adapter(name: str, path: str, max_rank: int, packed_modules: dict, known: frozenset[str]) -> Adapter:
    """load_adapter, and every module it adapts is one of `known`, the model's LoRA projections (the runner's
    lora_modules)."""
    adapter = load_adapter(name, path, max_rank, packed_modules)
    unknown = sorted(set(adapter.modules) - known)
    if unknown:
        raise ValueError(f"adapter {path!r} adapts {unknown[0]}, which this model does not have")
    return adapter
