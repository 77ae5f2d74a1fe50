"""Linear layers split across tensor-parallel ranks.

Every parameter carries two loaders: `weight_loader(param, tensor, shard_id)` takes one checkpoint
tensor (e.g. q_proj of a packed qkv_proj), `load_full(param, tensor)` takes the whole unsplit packed
tensor (dummy weights, so every tensor-parallel size builds the same model).
"""
from __future__ import annotations

import torch
from torch import nn

from engine.layers.fusion import act_and_mul, act_and_mul_linear, linear
from engine.layers.parallel import SINGLE, PushedSum, TPGroup, divide


class _Linear(nn.Module):
    split_dim = None  # the weight's dimension split across ranks: 0 (output features), 1 (input features)
    quant = None  # a QuantMethod where the checkpoint quantizes this layer (engine/layers/quant)
    # engine/lora/layers.py's LoRALinear where the engine serves LoRA adapters: add(x, out) adds each row's
    # adapter product to the projection's output
    lora = None

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPGroup, full_shape: tuple,
                 part_sizes: list[int] | None = None):
        super().__init__()
        self.tp = tp
        self.in_features, self.out_features, self.full_shape = in_features, out_features, full_shape
        self.part_sizes = part_sizes or [full_shape[0]]  # full (unsplit) output size of each packed part
        self.local_sizes = [divide(s, tp.size if self.split_dim == 0 else 1, "output features")
                            for s in self.part_sizes]
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.weight.full_shape = full_shape
        self.weight.weight_loader = self.weight_loader
        self.weight.load_full = self.load_full
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
            self.bias.full_shape = full_shape[:1]
            self.bias.weight_loader = self.weight_loader
            self.bias.load_full = self.load_full
        else:
            self.register_parameter("bias", None)

    @property
    def lora_active(self) -> bool:
        """Whether this step adds an adapter's product to this projection's (so no fusion may hide its input)."""
        return self.lora is not None and self.lora.active

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = linear(x, self.weight, self.bias) if self.quant is None else self.quant.apply(self, x, self.bias)
        return self.lora.add(x, out) if self.lora_active else out

    def part_index(self, shard_id) -> int:
        """The packed part a checkpoint tensor's shard id names."""
        return 0 if shard_id is None else shard_id

    def quantize(self, method) -> None:
        """Hold the checkpoint's quantized tensors (`method` registers them) in place of the float weight."""
        device = self.weight.device
        del self.weight
        if device.type == "cuda":  # the float weight's segment goes back: kept, the smaller tensors would split it,
            torch.cuda.empty_cache()  # and the KV cache's sizing would count its unused part as taken
        self.quant = method
        with torch.device(device):
            method.create_weights(self)


class ReplicatedLinear(_Linear):
    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__(in_features, out_features, bias, SINGLE, (out_features, in_features))

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        param.data.copy_(loaded)

    load_full = weight_loader


class ColumnParallelLinear(_Linear):
    """Output features split across ranks; the checkpoint tensor may be several packed parts."""

    split_dim = 0

    def __init__(self, in_features: int, part_sizes: list[int], bias: bool = False, tp: TPGroup = SINGLE):
        local_out = sum(divide(s, tp.size, "output features") for s in part_sizes)
        super().__init__(in_features, local_out, bias, tp, (sum(part_sizes), in_features), part_sizes)

    def _local_slice(self, part: int) -> tuple[int, int]:
        return sum(self.local_sizes[:part]), self.local_sizes[part]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int = 0) -> None:
        offset, size = self._local_slice(shard_id)
        param.data.narrow(0, offset, size).copy_(loaded.narrow(0, self.tp.rank * size, size))

    def load_full(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        start = 0
        for part, full_size in enumerate(self.part_sizes):
            self.weight_loader(param, loaded.narrow(0, start, full_size), part)
            start += full_size


class QKVParallelLinear(ColumnParallelLinear):
    SHARDS = {"q": 0, "k": 1, "v": 2}

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool = False, tp: TPGroup = SINGLE):
        sizes = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
        super().__init__(hidden_size, sizes, bias, tp)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=0) -> None:
        super().weight_loader(param, loaded, self.part_index(shard_id))

    def part_index(self, shard_id) -> int:
        return self.SHARDS.get(shard_id, shard_id) or 0


class RowParallelLinear(_Linear):
    """Input features split across ranks; outputs are summed over ranks. With reduce_results=False each
    rank returns its own part, for a later layer to sum (see RMSNorm's `tp`), or a PushedSum: its sum
    already on its way (large inputs, see TPGroup.partial_linear)."""

    split_dim = 1

    def __init__(self, in_features: int, out_features: int, bias: bool = False, tp: TPGroup = SINGLE,
                 reduce_results: bool = True):
        local_in = divide(in_features, tp.size, "input features")
        super().__init__(local_in, out_features, bias, tp, (out_features, in_features))
        self.reduce_results = reduce_results

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if param.dim() == 1:  # bias: added once, on rank 0
            param.data.copy_(loaded if self.tp.rank == 0 else torch.zeros_like(loaded))
            return
        size = param.shape[1]
        param.data.copy_(loaded.narrow(1, self.tp.rank * size, size))

    load_full = weight_loader

    def forward(self, x: torch.Tensor) -> "torch.Tensor | PushedSum":
        if self.quant is not None or self.lora_active:  # this rank's part of x @ A^T @ B^T joins its partial sum
            return self._reduced(super().forward(x))
        return self._reduced(self.tp.partial_linear(x, self.weight, self.bias))

    def forward_act_and_mul(self, gate_up: torch.Tensor, act: str = "silu") -> "torch.Tensor | PushedSum":
        """forward(act_and_mul(gate_up, act)); the activation is fused into the projection where this rank's
        part is a plain product (always for decode rows; see TPGroup.partial_linear)."""
        if self.quant is None and self.tp.is_plain_product(gate_up):
            out = act_and_mul_linear(gate_up, self.weight, self.bias, act)
            # an adapter's shrink computes the activation in its prologue too; its product joins this rank's part
            return self._reduced(self.lora.add_activated(gate_up, out, act) if self.lora_active else out)
        return self.forward(act_and_mul(gate_up, act))

    def _reduced(self, out):
        if not self.reduce_results:
            return out
        return out.wait() if isinstance(out, PushedSum) else self.tp.all_reduce(out)
