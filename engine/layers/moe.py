"""A mixture-of-experts block: a router picks each token's top-k experts, each expert is a gated MLP, and the
token's output is the routing-weighted sum of its experts' outputs.

    probs = softmax(gate(x))                    (float32; router_bias: gpt-oss's router has a bias)
    weights, experts = top_k(probs)             renormalize: weights / sum(weights) (Qwen's norm_topk_prob,
                                                Mixtral and gpt-oss always: a softmax over the top-k logits)
    y = sum_k weights[k] * down_e(act(gate_e(x), up_e(x)))       e = experts[k]

The experts are stacked: w13 [E, 2 * I, H] (each expert's gate rows, then its up rows) and w2 [E, H, I], with
optional biases b13 [E, 2 * I] and b2 [E, H] (gpt-oss). Activations: "silu" (SwiGLU: silu(gate) * up) and
"swiglu_clamped" (gpt-oss: gate clamped above at `limit`, up to [-limit, limit], then
(up + 1) * gate * sigmoid(alpha * gate)).

Tensor parallelism: every rank holds a slice of every expert's intermediate dimension (rows of w13's gate and
up parts, columns of w2) and the router whole, so each rank's output is its part of the sum over ranks, left
unsummed for the norm after the block (as GatedMLP(reduce_results=False)); b2 is added on rank 0 only.

On CUDA the routing and the experts run in the fused kernels (engine/kernels/fused_moe.py: the top-k in one
kernel, tokens sorted by expert, one grouped GEMM for gate/up and one for down); elsewhere, and inside
PlainTorch, `route` and `experts_reference` (expert by expert) in torch.

MXFP4 experts (gpt-oss as published, engine/layers/quant/mxfp4.py) replace w13 and w2 by their packed blocks and
scales (w13_blocks, w13_scales, w2_blocks, w2_scales): the fused kernels read them directly; the reference path
dequantizes them for each forward.

Checkpoints store the experts one by one (Qwen: mlp.experts.{e}.gate_proj / up_proj / down_proj, Mixtral:
block_sparse_moe.experts.{e}.w1 / w3 / w2) or fused (gpt-oss: gate_up_proj [E, H, 2I] with gate and up
interleaved column by column, down_proj [E, I, H]). Each stacked parameter's weight_loader takes a shard id
(expert, part): expert None means all experts at once; see ExpertWeights.
"""
from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.fusion import _kernels_for, act_and_mul, act_and_mul_linear
from engine.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from engine.layers.parallel import SINGLE, TPGroup, divide

ACTIVATIONS = ("silu", "swiglu_clamped")


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] float32, experts [T, k] int64) of the router's logits [T, E]: the softmax's top k, divided
    by their sum where renormalize (which equals a softmax over the top-k logits)."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts


def expert_act(gate_up: torch.Tensor, activation: str, alpha: float = 1.702, limit: float = 7.0) -> torch.Tensor:
    """The gated activation of [gate | up] rows (last dimension), in the input's dtype."""
    if activation == "silu":
        return act_and_mul(gate_up, "silu")
    gate, up = gate_up.chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def experts_reference(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                      experts: torch.Tensor, b13: torch.Tensor | None = None, b2: torch.Tensor | None = None,
                      activation: str = "silu", alpha: float = 1.702, limit: float = 7.0) -> torch.Tensor:
    """sum_k weights[:, k] * expert_{experts[:, k]}(x), expert by expert, in x's dtype (the CPU path, and what the
    fused kernels are tested against). x [T, H]; weights, experts [T, k]."""
    out = torch.zeros_like(x)
    flat = experts.flatten()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=w13.shape[0]).tolist()
    top_k = experts.shape[1]
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        slots = order[start:start + count]
        start += count
        tokens = slots // top_k
        gate_up = F.linear(x[tokens], w13[expert], None if b13 is None else b13[expert])
        y = F.linear(expert_act(gate_up, activation, alpha, limit), w2[expert], None if b2 is None else b2[expert])
        y = y * weights.flatten()[slots, None]
        out.index_add_(0, tokens, y.to(x.dtype))
    return out


class ExpertWeights(nn.Module):
    """The stacked expert weights of one rank: w13 [E, 2 * I_rank, H], w2 [E, H, I_rank] (and biases).

    A checkpoint tensor loads through weight_loader(param, tensor, (expert, part)):
      expert e, part "gate" / "up" / "down": one expert's [I, H] / [I, H] / [H, I] weight (or [I] / [I] / [H]
        bias): Qwen's gate_proj / up_proj / down_proj, Mixtral's w1 / w3 / w2;
      expert None, part "gate_up": every expert's [E, 2I, H] (gate rows, then up rows), or bias [E, 2I];
      expert None, part "gate_up_interleaved_t": [E, H, 2I] with gate and up in alternate columns (gpt-oss's
        gate_up_proj), or bias [E, 2I] alternating;
      expert None, part "down": [E, H, I], or bias [E, H]; "down_t": [E, I, H] (gpt-oss's down_proj).
    """

    quant = None  # a QuantMethod whose packed experts replace w13 and w2 (MXFP4)

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, bias: bool, tp: TPGroup):
        super().__init__()
        self.tp = tp
        self.num_experts, self.hidden_size = num_experts, hidden_size
        self.local_inter = divide(intermediate_size, tp.size, "moe intermediate size")
        local = self.local_inter
        self.w13 = self._param((num_experts, 2 * local, hidden_size), (num_experts, 2 * intermediate_size, hidden_size))
        self.w2 = self._param((num_experts, hidden_size, local), (num_experts, hidden_size, intermediate_size))
        if bias:
            self.b13 = self._param((num_experts, 2 * local), (num_experts, 2 * intermediate_size))
            self.b2 = self._param((num_experts, hidden_size), (num_experts, hidden_size))
        else:
            self.b13 = self.b2 = None

    def quantize(self, method) -> None:
        """Hold the checkpoint's quantized experts (`method` registers them) in place of w13 and w2."""
        device = self.w13.device
        del self.w13, self.w2
        self.w13 = self.w2 = None  # the biases' loaders ask which parameter they load
        if device.type == "cuda":  # the float experts' segments go back before the packed ones are made (as the
            torch.cuda.empty_cache()  # quantized linears do): the KV cache's sizing then counts them free
        self.quant = method
        with torch.device(device):
            method.create_experts(self)

    def _param(self, shape: tuple, full_shape: tuple) -> nn.Parameter:
        param = nn.Parameter(torch.empty(shape), requires_grad=False)
        param.full_shape = full_shape
        param.weight_loader = self.weight_loader
        param.load_full = self.load_full
        param.missing_shards = self.missing_shards  # bound to the module: a closure over param would be a cycle,
        # which keeps the float experts that MXFP4 replaces (quantize) allocated until the garbage collector runs
        return param

    def missing_shards(self, param: nn.Parameter, shard_ids: set) -> list[str]:
        """The (expert, part) shards a checkpoint loaded one expert at a time did not give `param`."""
        if any(shard is None or shard[0] is None for shard in shard_ids):  # loaded whole
            return []
        parts = ("down",) if param is self.w2 or param is self.b2 else ("gate", "up")
        return [f"expert {e} {part}" for e in range(self.num_experts) for part in parts if (e, part) not in shard_ids]

    def _rank_rows(self, loaded: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's slice of an intermediate dimension of the checkpoint's (unsplit) tensor."""
        full = self.local_inter * self.tp.size
        if loaded.shape[dim] != full:
            raise ValueError(f"expert tensor of shape {tuple(loaded.shape)} does not fit experts of intermediate "
                             f"size {full}")
        return loaded.narrow(dim, self.tp.rank * self.local_inter, self.local_inter)

    def load_full(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        """The whole stacked tensor in this module's layout (full_shape): dummy weights."""
        self.weight_loader(param, loaded, (None, "down" if param is self.w2 or param is self.b2 else "gate_up"))

    @torch.no_grad()
    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: tuple) -> None:
        expert, part = shard_id
        dest = param.data if expert is None else param.data[expert]
        if param is self.w2 or param is self.b2:
            if part not in ("down", "down_t"):
                raise ValueError(f"expert part {part!r} does not load into the down projection")
            if param is self.b2:  # added once, on rank 0
                _copy(dest, loaded if self.tp.rank == 0 else torch.zeros_like(loaded))
                return
            _copy(dest, self._rank_rows(loaded.transpose(-1, -2) if part == "down_t" else loaded, -1))
            return
        is_bias = param is self.b13
        inter_dim = dest.dim() - (1 if is_bias else 2)  # the intermediate dimension: rows of a weight
        if part == "gate_up_interleaved_t":  # gpt-oss: [E, H, 2I] (bias [E, 2I]), gate and up alternating
            if not is_bias:
                loaded = loaded.transpose(-1, -2)
            parts = {"gate": loaded.unflatten(1, (-1, 2)).select(2, 0),
                     "up": loaded.unflatten(1, (-1, 2)).select(2, 1)}
        elif part == "gate_up":
            gate, up = loaded.chunk(2, dim=inter_dim)
            parts = {"gate": gate, "up": up}
        elif part in ("gate", "up"):
            parts = {part: loaded}
        else:
            raise ValueError(f"expert part {part!r} does not load into the gate/up projection")
        for name, tensor in parts.items():
            offset = 0 if name == "gate" else self.local_inter
            _copy(dest.narrow(inter_dim, offset, self.local_inter), self._rank_rows(tensor, inter_dim))


def _copy(dest: torch.Tensor, loaded: torch.Tensor) -> None:
    if dest.shape != loaded.shape:
        raise ValueError(f"expert tensor of shape {tuple(loaded.shape)} does not fit {tuple(dest.shape)}")
    dest.copy_(loaded)


class FusedMoE(nn.Module):
    """Router and experts of one layer; forward(x) is this rank's part of the block's output (see the module's
    docstring). x: the normed rows [T, H]."""

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int, tp: TPGroup = SINGLE,
                 renormalize: bool = True, activation: str = "silu", expert_bias: bool = False,
                 router_bias: bool = False, swiglu_alpha: float = 1.702, swiglu_limit: float = 7.0):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"expert activation {activation!r} is not supported; supported: {', '.join(ACTIVATIONS)}")
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok ({top_k}) must be between 1 and the number of experts ({num_experts})")
        self.top_k, self.renormalize = top_k, renormalize
        self.activation, self.alpha, self.limit = activation, swiglu_alpha, swiglu_limit
        self.gate = ReplicatedLinear(hidden_size, num_experts, bias=router_bias)
        self.experts = ExpertWeights(num_experts, hidden_size, intermediate_size, expert_bias, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits, e = self.gate(x), self.experts
        packed = e.quant is not None
        kernels = _kernels_for(x, None if packed else e.w13, "fused_moe")
        if kernels is None:
            if x.is_cuda and torch.cuda.is_current_stream_capturing():  # the reference sizes its loop on the host
                raise ValueError("a mixture-of-experts model in plain PyTorch (fused_layers=False) on a GPU needs "
                                 "enforce_eager=True")
            weights, experts = route(logits, self.top_k, self.renormalize)
            w13, w2 = e.quant.dequantized(e, x.dtype) if packed else (e.w13, e.w2)
            return experts_reference(x, w13, w2, weights, experts, e.b13, e.b2, self.activation, self.alpha,
                                     self.limit)
        weights, experts = kernels.route_top_k(logits, self.top_k, self.renormalize)
        if packed:
            return kernels.fused_experts(x, e.w13_blocks, e.w2_blocks, weights, experts, e.b13, e.b2, self.activation,
                                         self.alpha, self.limit, mxfp4_scales=(e.w13_scales, e.w2_scales))
        return kernels.fused_experts(x, e.w13, e.w2, weights, experts, e.b13, e.b2, self.activation, self.alpha,
                                     self.limit)


class SharedExpert(nn.Module):
    """Qwen2-MoE's shared expert: a gated MLP every token takes, scaled by sigmoid(shared_expert_gate(x)). Its
    down projection is this rank's plain part (the MoE block's output is summed by the norm after it)."""

    def __init__(self, hidden_size: int, intermediate_size: int, tp: TPGroup):
        super().__init__()
        self.gate_up_proj = ColumnParallelLinear(hidden_size, [intermediate_size] * 2, tp=tp)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, tp=tp, reduce_results=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return act_and_mul_linear(self.gate_up_proj(x), self.down_proj.weight, None, "silu")


class SharedExpertMoE(nn.Module):
    """Routed experts plus a gated shared expert (Qwen2-MoE): moe(x) + sigmoid(shared_expert_gate(x)) * shared(x)."""

    def __init__(self, moe: FusedMoE, hidden_size: int, shared_intermediate_size: int, tp: TPGroup):
        super().__init__()
        self.moe = moe
        self.shared_expert = SharedExpert(hidden_size, shared_intermediate_size, tp)
        self.shared_expert_gate = ReplicatedLinear(hidden_size, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shared = self.shared_expert(x) * torch.sigmoid(self.shared_expert_gate(x))
        return self.moe(x) + shared


# one expert's tensor in a checkpoint: <layer>.<block>.experts.<e>.<name>.(weight|bias)
_EXPERT_TENSOR = re.compile(r"^(?P<layer>.+)\.(?P<block>mlp|block_sparse_moe)\.experts\.(?P<expert>\d+)\."
                            r"(?P<name>[a-z0-9_]+)\.(?P<kind>weight|bias)$")
# checkpoint names of each expert's projections → ExpertWeights parts (Qwen's, Mixtral's)
EXPERT_PROJECTIONS = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down", "w1": "gate", "w3": "up", "w2": "down"}


def expert_checkpoint_target(name: str, block: str = "mlp") -> tuple[str, tuple] | None:
    """(our parameter's name, (expert, part)) of one expert's checkpoint tensor, or None for other tensors. Our
    modules put the block at `<layer>.mlp` (`block` = "mlp") and the routed experts at `experts` (or
    `mlp.moe.experts` beside a shared expert: block = "mlp.moe")."""
    match = _EXPERT_TENSOR.match(name)
    if match is None or match["name"] not in EXPERT_PROJECTIONS:
        return None
    part = EXPERT_PROJECTIONS[match["name"]]
    param = ("w2" if part == "down" else "w13") if match["kind"] == "weight" else ("b2" if part == "down" else "b13")
    return f"{match['layer']}.{block}.experts.{param}", (int(match["expert"]), part)
