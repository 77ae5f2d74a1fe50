"""Weights into a built model: safetensors checkpoints, or random "dummy" weights."""
from __future__ import annotations

import zlib
from glob import glob
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from engine.layers.quant import QuantMethod, after_loading, quantize_linears


def load_weights(model: nn.Module, model_dir: str, load_format: str, seed: int = 0,
                 quantization: QuantMethod | None = None) -> bool:
    """Load the model's weights; whether it has an LM head (an embedding checkpoint may have none).
    quantization: the checkpoint's (EngineConfig.quantization): the linears it quantizes hold its tensors."""
    if quantization is not None:
        quantize_linears(model, quantization)
    if load_format == "dummy":
        load_dummy_weights(model, seed)
        has_lm_head = True
    else:
        has_lm_head = load_safetensors(model, model_dir)
    after_loading(model)
    return has_lm_head


def load_safetensors(model: nn.Module, model_dir: str) -> bool:
    """The checkpoint's tensors into `model`; whether it has an LM head (tied, or an lm_head tensor). A
    checkpoint of the bare decoder (a `Qwen3Model` as embedding models publish it: no `model.` prefix, no
    lm_head) loads into the decoder."""
    files = sorted(glob(str(Path(model_dir) / "*.safetensors")))
    if not files:
        raise ValueError(f"no *.safetensors files in {model_dir}; use load_format='dummy' for random weights")
    params = dict(model.named_parameters(remove_duplicate=False))
    packed = getattr(model, "packed_modules", {})
    renamed = getattr(model, "checkpoint_prefixes", {})
    # a model whose tensors need more than a packed_modules entry (one expert of stacked experts) maps them itself
    own_target = getattr(model, "checkpoint_target", lambda name: None)
    loaded: dict[str, set] = {}  # each loaded parameter's shard ids
    for file in files:
        with safe_open(file, "pt", "cpu") as f:
            for name in f.keys():
                if "rotary_emb.inv_freq" in name:
                    continue
                if name == "lm_head.weight" and getattr(model, "tie_word_embeddings", False):
                    continue
                ours = _renamed(name, renamed)
                target, shard_id = own_target(ours) or _target_name(ours, packed)
                if target not in params and f"model.{target}" in params:  # the bare decoder's layout
                    target = f"model.{target}"
                param = params.get(target)
                if param is None:
                    raise ValueError(_no_place(name, model))
                tensor = f.get_tensor(name).to(param.dtype)
                full_shape = getattr(param, "full_shape", None)
                if shard_id is None and full_shape is not None and tuple(tensor.shape) != tuple(full_shape):
                    raise ValueError(f"checkpoint tensor {name!r} of shape {tuple(tensor.shape)} does not fit "
                                     f"{target} of shape {tuple(full_shape)}")
                if shard_id is None:  # the whole tensor (for a packed parameter, all its parts: Phi-3's qkv_proj)
                    getattr(param, "load_full", _copy_loader)(param, tensor)
                else:
                    param.weight_loader(param, tensor, shard_id)
                loaded.setdefault(target, set()).add(shard_id)
    missing = {n for n in params if n not in loaded} - {"lm_head.weight"}
    if missing:
        raise ValueError(f"checkpoint in {model_dir} lacks weights for: {', '.join(sorted(missing)[:5])}")
    for name, shard_ids in loaded.items():  # a parameter of many shards (stacked experts) says which it lacks
        lacking = getattr(params[name], "missing_shards", lambda param, ids: [])(params[name], shard_ids)
        if lacking:
            raise ValueError(f"checkpoint in {model_dir} lacks {name} for: {', '.join(lacking[:5])}")
    return model.tie_word_embeddings or "lm_head.weight" in loaded


# the tensors quantized checkpoints carry beside (or instead of) their weights
QUANTIZED_TENSOR_SUFFIXES = ("weight_scale", "weight_scale_inv", "input_scale", "qweight", "qzeros", "scales",
                             "g_idx", "weight_zero_point", "weight_packed", "SCB", "absmax", "quant_map",
                             "quant_state.bitsandbytes__nf4", "quant_state.bitsandbytes__fp4")


def _no_place(name: str, model: nn.Module) -> str:
    if name.endswith(QUANTIZED_TENSOR_SUFFIXES):
        return (f"checkpoint tensor {name!r} is a quantized layer's, and this engine runs that layer of "
                f"{type(model).__name__} in float only, or config.json has no quantization_config: use the "
                "model's float (bf16/fp16) checkpoint")
    return f"checkpoint tensor {name!r} has no place in {type(model).__name__}"


def _copy_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"checkpoint tensor of shape {tuple(loaded.shape)} does not fit parameter {tuple(param.shape)}")
    param.data.copy_(loaded)


def _renamed(name: str, prefixes: dict) -> str:
    """A checkpoint name under the model's own module names: the first of its other layouts' prefixes it
    starts with replaced (a model's `checkpoint_prefixes`, {checkpoint prefix: module prefix})."""
    for ckpt_prefix, module_prefix in prefixes.items():
        if name.startswith(ckpt_prefix):
            return module_prefix + name[len(ckpt_prefix):]
    return name


def _target_name(name: str, packed: dict) -> tuple[str, object]:
    for ckpt_part, (param_part, shard_id) in packed.items():
        if f".{ckpt_part}." in name:
            return name.replace(f".{ckpt_part}.", f".{param_part}."), shard_id
    return name, None


@torch.no_grad()
def load_dummy_weights(model: nn.Module, seed: int) -> None:
    """Random weights that depend only on (seed, parameter name), never on the tensor-parallel layout."""
    for name, param in model.named_parameters():
        full_shape = getattr(param, "full_shape", None) or param.shape  # None: a per-tensor scale's
        gen = torch.Generator(device=param.device).manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        if name.endswith("norm.weight"):
            full = torch.ones(full_shape, device=param.device, dtype=param.dtype)
        elif hasattr(param, "dummy_value"):  # a quantized layer's scale: its weight's values stand as they are
            full = torch.full(full_shape, param.dummy_value, device=param.device, dtype=param.dtype)
        else:
            full = torch.empty(full_shape, device=param.device, dtype=torch.float32)
            full.normal_(0.0, 0.02, generator=gen)
            full = full.to(param.dtype)
        loader = getattr(param, "load_full", None)
        if loader is None:
            param.data.copy_(full)
        else:
            loader(param, full)
