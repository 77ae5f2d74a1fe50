"""Weights into a built model: safetensors checkpoints, or random "dummy" weights."""
from __future__ import annotations

import zlib
from glob import glob
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn


def load_weights(model: nn.Module, model_dir: str, load_format: str, seed: int = 0) -> None:
    if load_format == "dummy":
        load_dummy_weights(model, seed)
    else:
        load_safetensors(model, model_dir)


def load_safetensors(model: nn.Module, model_dir: str) -> None:
    files = sorted(glob(str(Path(model_dir) / "*.safetensors")))
    if not files:
        raise ValueError(f"no *.safetensors files in {model_dir}; use load_format='dummy' for random weights")
    params = dict(model.named_parameters(remove_duplicate=False))
    packed = getattr(model, "packed_modules", {})
    loaded: set[str] = set()
    for file in files:
        with safe_open(file, "pt", "cpu") as f:
            for name in f.keys():
                if "rotary_emb.inv_freq" in name:
                    continue
                if name == "lm_head.weight" and getattr(model, "tie_word_embeddings", False):
                    continue
                target, shard_id = _target_name(name, packed)
                param = params.get(target)
                if param is None:
                    raise ValueError(f"checkpoint tensor {name!r} has no place in {type(model).__name__}")
                loader = getattr(param, "weight_loader", _copy_loader)
                loader(param, f.get_tensor(name).to(param.dtype), shard_id)
                loaded.add(target)
    missing = {n for n in params if n not in loaded} - ({"lm_head.weight"} if model.tie_word_embeddings else set())
    if missing:
        raise ValueError(f"checkpoint in {model_dir} lacks weights for: {', '.join(sorted(missing)[:5])}")


def _copy_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"checkpoint tensor of shape {tuple(loaded.shape)} does not fit parameter {tuple(param.shape)}")
    param.data.copy_(loaded)


def _target_name(name: str, packed: dict) -> tuple[str, object]:
    for ckpt_part, (param_part, shard_id) in packed.items():
        if f".{ckpt_part}." in name:
            return name.replace(f".{ckpt_part}.", f".{param_part}."), shard_id
    return name, None


@torch.no_grad()
def load_dummy_weights(model: nn.Module, seed: int) -> None:
    """Random weights that depend only on (seed, parameter name), never on the tensor-parallel layout."""
    for name, param in model.named_parameters():
        full_shape = getattr(param, "full_shape", param.shape)
        gen = torch.Generator(device=param.device).manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        if name.endswith("norm.weight"):
            full = torch.ones(full_shape, device=param.device, dtype=param.dtype)
        else:
            full = torch.empty(full_shape, device=param.device, dtype=torch.float32)
            full.normal_(0.0, 0.02, generator=gen)
            full = full.to(param.dtype)
        loader = getattr(param, "load_full", None)
        if loader is None:
            param.data.copy_(full)
        else:
            loader(param, full)
