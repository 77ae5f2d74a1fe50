"""fp8 (e4m3) weights, as published: `quant_method: "fp8"` (Qwen3-*-FP8, DeepSeek: blocks of 128 x 128, each
with a float32 `weight_scale_inv`; or per-tensor: a `weight_scale` per tensor, an `input_scale` where the
activations' scale is static) and compressed-tensors' float-quantized fp8 (RedHat/neuralmagic: a `weight_scale`
per tensor, per output channel or per block; activations dynamic per token or static per tensor).

Dequantized weight = fp8 weight x its scale (of its block, channel or tensor). A packed projection (qkv, gate/up)
keeps each part's scales: per-tensor scales become a per-output-channel scale, exact for every part. On CPU (and
GPUs before compute capability 8.9) the weight is dequantized to the activations' dtype for each product; on CUDA
the activations are quantized to fp8 per token (per token and group of 128 for blocks) and multiplied on the
tensor cores, the scales applied per K block or in the epilogue (engine/kernels/fp8_gemm.py).
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.fusion import _kernels_for as kernel_module
from engine.layers.quant import QuantMethod, single_config_group

FP8 = torch.float8_e4m3fn


class Fp8Method(QuantMethod):
    """`quant_method: "fp8"`. granularity: "block" (of weight_block) | "channel" | "tensor"; static_input: the
    checkpoint has a per-tensor `input_scale` for the activations."""

    name = "fp8"
    scale_name = "weight_scale"

    def __init__(self, config: dict):
        super().__init__(config)
        self.not_converted = list(config.get("modules_to_not_convert") or config.get("ignored_layers") or [])
        block = config.get("weight_block_size")
        self.weight_block = tuple(block) if block else None
        self.granularity = "block" if block else "tensor"
        if block:
            self.scale_name = "weight_scale_inv"
            if len(block) != 2 or not all(isinstance(b, int) and b > 0 for b in block):
                raise ValueError(f"fp8 weight_block_size must be two positive integers, got {block!r}")
        scheme = config.get("activation_scheme", "dynamic")
        if scheme not in ("dynamic", "static"):
            raise ValueError(f"fp8 activation_scheme {scheme!r} is not supported; supported: dynamic, static")
        if block and scheme != "dynamic":
            raise ValueError("block-wise fp8 with activation_scheme 'static' is not supported; supported: dynamic")
        self.static_input = scheme == "static"

    # ---- the checkpoint's tensors on each rank ------------------------------------------------------------

    def create_weights(self, layer: nn.Module) -> None:
        block_n, block_k = self.weight_block or (1, 1)
        self._check_blocks(layer, block_n, block_k)
        _register(layer, "weight", FP8, (1, 1), layer.full_shape)
        n_full, k_full = layer.full_shape
        if self.granularity == "block":
            full = (sum(_units(size, block_n) for size in layer.part_sizes), _units(k_full, block_k))  # blocks per part
            _register(layer, self.scale_name, torch.float32, (block_n, block_k), full, dummy_value=1.0)
        elif self.granularity == "channel":
            _register(layer, self.scale_name, torch.float32, (1, 0), (n_full, 1), dummy_value=1.0)
        else:
            _register(layer, self.scale_name, torch.float32, (0, 0), None, dummy_value=1.0)
        if self.static_input:
            _register(layer, "input_scale", torch.float32, (0, 0), None, dummy_value=1.0)

    def _check_blocks(self, layer: nn.Module, block_n: int, block_k: int) -> None:
        """Under tensor parallelism a 128-block never splits across ranks."""
        if layer.tp.size == 1 or self.granularity != "block":
            return
        if layer.split_dim == 0 and any(size % block_n for size in layer.local_sizes):
            raise ValueError(f"tensor_parallel_size {layer.tp.size} would split the fp8 weight blocks of {block_n} "
                             f"rows: a rank would hold {layer.local_sizes} output features; use a size that "
                             f"leaves a multiple of {block_n}")
        if layer.split_dim == 1 and layer.in_features % block_k:
            raise ValueError(f"tensor_parallel_size {layer.tp.size} would split the fp8 weight blocks of {block_k} "
                             f"columns: a rank would hold {layer.in_features} input features; use a size that "
                             f"leaves a multiple of {block_k}")

    def after_loading(self, layer: nn.Module) -> None:
        """The scales as the product reads them: each output row's block-scale row, or one float32 scale per
        output channel (a per-tensor scale repeated over its part's rows); the static input scale's max over
        the packed parts (the activations are quantized once for all of them)."""
        scale = getattr(layer, self.scale_name)
        device = scale.device
        if self.granularity == "block":
            block_n = self.weight_block[0]
            rows, first = [], 0
            for size in layer.local_sizes:
                rows.append(first + torch.arange(size, device=device) // block_n)
                first += -(-size // block_n)
            layer.register_buffer("scale_row", torch.cat(rows).to(torch.int32), persistent=False)
        elif self.granularity == "channel":
            layer.register_buffer("channel_scale", scale.reshape(-1).contiguous(), persistent=False)
        else:
            sizes = torch.tensor(layer.local_sizes, device=device)
            layer.register_buffer("channel_scale", scale.repeat_interleave(sizes), persistent=False)
        if self.static_input:
            layer.register_buffer("input_scale_max", layer.input_scale.max().reshape(1), persistent=False)

    # ---- the product -----------------------------------------------------------------------------------

    def dequantized_weight(self, layer: nn.Module, dtype: torch.dtype) -> torch.Tensor:
        """The layer's weight as float values of `dtype`: fp8 x scale in float32, rounded once."""
        weight = layer.weight.float()
        if self.granularity == "block":
            block_n, block_k = self.weight_block
            scale = getattr(layer, self.scale_name)[layer.scale_row.long()]
            scale = scale.repeat_interleave(block_k, dim=1)[:, :weight.shape[1]]
            return (weight * scale).to(dtype)
        return (weight * layer.channel_scale[:, None]).to(dtype)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        # the GEMM steps K by a block's width: one the fp8 tensor cores take (a power of two, at least 32)
        block_k = self.weight_block[1] if self.weight_block else 128
        kernels = _kernels_for(x) if block_k >= 32 and block_k & (block_k - 1) == 0 else None
        if kernels is None:
            return F.linear(x, self.dequantized_weight(layer, x.dtype), bias)
        rows = x.reshape(-1, x.shape[-1])
        if self.granularity == "block":
            out = kernels.fp8_block_linear(rows, layer.weight, getattr(layer, self.scale_name), layer.scale_row,
                                           self.weight_block[1], bias)
        else:
            input_scale = layer.input_scale_max if self.static_input else None
            out = kernels.fp8_channel_linear(rows, layer.weight, layer.channel_scale, bias, input_scale)
        return out.reshape(*x.shape[:-1], out.shape[-1])


class CompressedTensorsFp8Method(Fp8Method):
    """compressed-tensors' float-quantized fp8: its config group's weights {num_bits 8, type float, strategy
    tensor | channel | block} and input activations {dynamic per token} or {static per tensor}; `ignore`d
    modules stay float. Tensors: weight, weight_scale, input_scale."""

    name = "compressed-tensors"

    def __init__(self, config: dict):
        QuantMethod.__init__(self, config)
        self.not_converted = list(config.get("ignore") or [])
        weights, inputs = single_config_group(config)
        if (weights.get("num_bits"), weights.get("type")) != (8, "float"):
            raise ValueError(f"compressed-tensors float-quantized weights of {weights.get('num_bits')} bits, type "
                             f"{weights.get('type')!r} are not supported; supported: 8-bit float (fp8)")
        strategy = weights.get("strategy")
        if strategy not in ("tensor", "channel", "block"):
            raise ValueError(f"compressed-tensors fp8 weight strategy {strategy!r} is not supported; supported: "
                             "tensor, channel, block")
        self.granularity = strategy
        self.weight_block = tuple(weights.get("block_structure") or (128, 128)) if strategy == "block" else None
        self.static_input = False
        if inputs is not None:
            dynamic, in_strategy = inputs.get("dynamic"), inputs.get("strategy")
            if (inputs.get("num_bits"), inputs.get("type")) != (8, "float") or \
                    (dynamic, in_strategy) not in ((True, "token"), (False, "tensor"), (True, "group")):
                raise ValueError(f"compressed-tensors fp8 input activations {in_strategy!r} (dynamic={dynamic}) "
                                 "are not supported; supported: dynamic per token, static per tensor")
            self.static_input = not dynamic
            if strategy == "block" and (self.static_input or inputs.get("group_size") != self.weight_block[1]):
                raise ValueError("compressed-tensors block-wise fp8 takes input activations dynamic per group of its "
                                 f"blocks' width ({self.weight_block[1]}); got {in_strategy!r} "
                                 f"(group_size={inputs.get('group_size')}, dynamic={dynamic})")


def _register(layer: nn.Module, name: str, dtype: torch.dtype, block: tuple[int, int], full_shape,
              dummy_value: float | None = None) -> None:
    """A parameter of the checkpoint's tensor `name`, this rank's slice of it. block (rows, columns): how many
    of the weight's rows and columns one element stands for; 0 for a dimension the tensor lacks (a per-tensor
    scale: one element per packed part; a per-channel scale's column)."""
    shape = _local_shape(layer, block)
    param = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
    param.full_shape = full_shape
    param.weight_loader = functools.partial(_load_part, layer, block)
    param.load_full = functools.partial(_load_full, layer, block)
    if dummy_value is not None:
        param.dummy_value = dummy_value
    layer.register_parameter(name, param)


def _units(size: int, block: int) -> int:
    return -(-size // block)


def _local_shape(layer: nn.Module, block: tuple[int, int]) -> tuple:
    block_n, block_k = block
    if block_n == 0:
        return (len(layer.local_sizes),)
    rows = sum(_units(size, block_n) for size in layer.local_sizes)
    return (rows, 1 if block_k == 0 else _units(layer.in_features, block_k))


def _load_part(layer: nn.Module, block: tuple[int, int], param: nn.Parameter, loaded: torch.Tensor,
               shard_id=None) -> None:
    """One checkpoint tensor (one packed part's, where shard_id names it): this rank's slice into its place."""
    part = layer.part_index(shard_id)
    block_n, block_k = block
    if block_n == 0:  # one scale per part
        param.data[part] = loaded.reshape(())
        return
    if len(layer.part_sizes) > 1 and shard_id is None:
        _load_full(layer, block, param, loaded)
        return
    rank = layer.tp.rank
    if layer.split_dim == 0:
        size = _units(layer.local_sizes[part], block_n)
        first = sum(_units(s, block_n) for s in layer.local_sizes[:part])
        param.data.narrow(0, first, size).copy_(loaded.reshape(-1, param.shape[1]).narrow(0, rank * size, size))
    elif layer.split_dim == 1 and block_k != 0:
        size = param.shape[1]
        param.data.copy_(loaded.narrow(1, rank * size, size))
    else:
        param.data.copy_(loaded.reshape(param.shape))


def _load_full(layer: nn.Module, block: tuple[int, int], param: nn.Parameter, loaded: torch.Tensor) -> None:
    """A whole packed tensor (dummy weights): each part's rows in turn."""
    if block[0] == 0:
        for part in range(len(layer.part_sizes)):
            param.data[part] = loaded.reshape(-1)[min(part, loaded.numel() - 1)]
        return
    if layer.split_dim != 0 or len(layer.part_sizes) == 1:
        _load_part(layer, block, param, loaded, None)
        return
    first = 0
    for part, size in enumerate(layer.part_sizes):
        rows = _units(size, block[0])
        _load_part(layer, block, param, loaded.narrow(0, first, rows), part)
        first += rows


@functools.cache
def _fp8_capable(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device) >= (8, 9)


def _kernels_for(x: torch.Tensor):
    """engine.kernels.fp8_gemm where the product runs there: CUDA with fp8 tensor cores, outside PlainTorch."""
    kernels = kernel_module(x, None, "fp8_gemm")
    return kernels if kernels is not None and _fp8_capable(x.device) else None
