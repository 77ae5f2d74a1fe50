"""Int4 weights in groups along the input dimension: AWQ (gemm), GPTQ (4-bit; sym and asym; desc_act false and
true) and compressed-tensors pack-quantized, each loaded from its own tensors and repacked once into the one
layout the kernels read (engine/kernels/int4_gemm.py):

    qweight int32 [K / 8, N_rank]    q[k, n] in 0..15, eight rows of K an int32 (nibble j: row 8i + j)
    scales        [K / G, N_rank]    the checkpoint's float dtype (fp16 for AWQ and GPTQ)
    zeros   uint8 [K / G, N_rank]    W[k, n] = (q[k, n] - zeros[k // G, n]) * scales[k // G, n]
    perm    int64 [K_rank] or none   GPTQ desc_act: input features in group order (see below)

with K the layer's input features and N its output features (this rank's slice of one of them). How each format
stores them (K in, N out; "packed along X": eight consecutive values of X in an int32, value j at bits 4j):

  AWQ gemm   qweight [K, N / 8] and qzeros [K / G, N / 8], packed along N in the order 0, 2, 4, 6, 1, 3, 5, 7
             (nibble j holds column AWQ_ORDER[j] of its eight); scales [K / G, N]; W = (q - z) * s
  GPTQ       qweight [K / 8, N] packed along K; qzeros [K / G, N / 8] packed along N; scales [K / G, N];
             g_idx [K], each input feature's group. The original format (checkpoint_format "gptq") stores each
             zero minus one (a symmetric checkpoint's 8 as 7), "gptq_v2" the zero itself
  pack-quantized (compressed-tensors, strategy group or channel): weight_packed [N, K / 8] packed along K,
             values stored as q + 8 (q signed, -8..7); weight_scale [N, K / G]; weight_zero_point (asymmetric
             only) [N / 8, K / G] packed along N, stored + 8 alike; weight_shape [2] = (N, K); W = (q - zp) * s

desc_act: GPTQ's act-order checkpoints quantized input features in an order of their own, so a group's
features are scattered: g_idx says which group each belongs to. Rather than look groups up per row in the
kernels, the rows are sorted by group once at load (as vLLM's exllama path does), the permutation kept, and
the activations' features gathered in that order before the product: x[:, perm] @ W[perm] = x @ W.

Tensor parallelism: a column-parallel layer keeps its slice of N of every tensor; a row-parallel one its slice
of K, which must hold whole groups (a tensor_parallel_size that splits a group is refused in one line). A
row-parallel layer of a desc_act checkpoint takes tensor_parallel_size 1 only: its rank's features belong to
groups scattered over every rank.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.fusion import _kernels_for
from engine.layers.quant import QuantMethod, single_config_group

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
_AWQ_UNDO = tuple(AWQ_ORDER.index(c) for c in range(8))  # column c of eight sits in nibble _AWQ_UNDO[c]


def unpack_int4(packed: torch.Tensor, dim: int) -> torch.Tensor:
    """uint8 values 0..15 of an int32 tensor packed along `dim` (eight consecutive values an int32, value j at
    bits 4j): that dimension grows eightfold."""
    dim = dim % packed.dim()
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)
    view = [1] * (packed.dim() + 1)
    view[dim + 1] = 8
    values = (packed.to(torch.int32).unsqueeze(dim + 1) >> shifts.view(view)) & 0xF
    return values.flatten(dim, dim + 1).to(torch.uint8)


def pack_int4(values: torch.Tensor, dim: int) -> torch.Tensor:
    """The int32 tensor that unpack_int4(., dim) turns back into `values` (0..15; that dimension a multiple
    of 8)."""
    dim = dim % values.dim()
    if values.shape[dim] % 8:
        raise ValueError(f"int4 values of shape {tuple(values.shape)} cannot be packed by eight along dim {dim}")
    grouped = values.to(torch.int32).unflatten(dim, (-1, 8))
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=values.device)
    view = [1] * grouped.dim()
    view[dim + 1] = 8
    return _or_reduce(grouped << shifts.view(view), dim + 1)


def _or_reduce(x: torch.Tensor, dim: int) -> torch.Tensor:
    """The bitwise or of x's slices along dim (the nibbles never overlap)."""
    out = torch.zeros_like(x.select(dim, 0))
    for j in range(x.shape[dim]):
        out |= x.select(dim, j)
    return out


def awq_unpack(packed: torch.Tensor) -> torch.Tensor:
    """AWQ's qweight [K, N / 8] or qzeros [K / G, N / 8]: uint8 [rows, N] in column order."""
    values = unpack_int4(packed, -1)
    return values.unflatten(-1, (-1, 8))[..., list(_AWQ_UNDO)].flatten(-2)


def awq_pack(values: torch.Tensor) -> torch.Tensor:
    """The AWQ packing of uint8 [rows, N] (the inverse of awq_unpack)."""
    return pack_int4(values.unflatten(-1, (-1, 8))[..., list(AWQ_ORDER)].flatten(-2), -1)


def dequantize(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """W [K, N] in `dtype` of the layout above (computed in float32, rounded once)."""
    q = unpack_int4(qweight, 0).float()
    group = q.shape[0] // scales.shape[0]
    w = (q - zeros.float().repeat_interleave(group, 0)) * scales.float().repeat_interleave(group, 0)
    return w.to(dtype)


def group_order(g_idx: torch.Tensor, group_size: int) -> torch.Tensor | None:
    """The permutation that puts GPTQ's input features in group order, None where they already are; ValueError
    where g_idx does not give each group group_size features."""
    g_idx = g_idx.long()
    k = g_idx.numel()
    natural = torch.arange(k, device=g_idx.device) // group_size
    if torch.equal(g_idx, natural):
        return None
    perm = torch.argsort(g_idx, stable=True)
    if not torch.equal(g_idx[perm], natural):
        raise ValueError(f"GPTQ g_idx does not put {group_size} input features in each group; the engine runs "
                         "group-ordered (desc_act) checkpoints of equal groups only")
    return perm


# ---- the methods ------------------------------------------------------------------------------------------

# dummy weights (load_format="dummy"): packed words of varied nibbles, zeros of 7 and 8, scales of the size a float
# model's dummy weights have (std ~0.02)
DUMMY_PACKED = 0x3A7B5C9D
DUMMY_ZEROS = 0x78787878
DUMMY_SCALE = 2.0 ** -8  # exact in fp16, the dtype the scales are kept in


class Int4Method(QuantMethod):
    """The int4 formats' common part. Subclasses name the checkpoint's tensors (`tensors`: checkpoint name →
    kind "q", "z", "s", "g_idx" or "ignored", with its full shape) and turn each into values over (rows, N)
    (`values`)."""

    zero_point = True  # the checkpoint stores zeros (else every zero is 8)
    desc_act = False

    def __init__(self, config: dict, group_size: int):
        super().__init__(config)
        if group_size != -1 and (group_size <= 0 or group_size % 8):
            raise ValueError(f"{self.name} group_size {group_size} is not supported; supported: a positive "
                             "multiple of 8, or -1 (one group per output channel)")
        self.group_size = group_size

    def tensors(self, n: int, k: int, group: int) -> dict[str, tuple[str, tuple]]:
        raise NotImplementedError

    def values(self, kind: str, loaded: torch.Tensor) -> torch.Tensor:
        """A checkpoint tensor as [rows, N] values (K rows for q and g_idx, K / G rows for z and s)."""
        raise NotImplementedError

    # ---- the checkpoint's tensors on each rank ------------------------------------------------------------

    def layer_group(self, layer: nn.Module) -> int:
        """The group size over this rank's input features; ValueError where tensor parallelism splits a group."""
        k_full = layer.full_shape[1]
        group = k_full if self.group_size == -1 else self.group_size
        if k_full % group:
            raise ValueError(f"{self.name} groups of {group} do not tile the {k_full} input features of a layer")
        if layer.split_dim == 1 and layer.tp.size > 1:
            if self.desc_act:
                raise ValueError(f"{self.name} desc_act checkpoints run with tensor_parallel_size 1: a row-parallel "
                                 "rank's input features belong to groups spread over every rank")
            if self.group_size == -1:
                return layer.in_features  # one group per channel: every rank's slice of it
            if layer.in_features % group:
                raise ValueError(f"tensor_parallel_size {layer.tp.size} would split the {self.name} groups of {group} "
                                 f"input features: a rank would hold {layer.in_features}; use a size that leaves a "
                                 f"multiple of {group}")
        return group

    def create_weights(self, layer: nn.Module) -> None:
        n_full, k_full = layer.full_shape
        group = self.layer_group(layer)
        layer.group_size = group
        n, k = layer.out_features, layer.in_features
        full_groups = k_full // (k_full if self.group_size == -1 else self.group_size)
        local = {"q": (k // 8, n), "z": (k // group, n), "s": (k // group, n), "g_idx": (k,), "ignored": (2,)}
        dtypes = {"q": torch.int32, "z": torch.int32, "s": torch.float32, "g_idx": torch.int32,
                  "ignored": torch.int32}
        dummies = {"q": DUMMY_PACKED, "z": DUMMY_ZEROS, "s": DUMMY_SCALE, "g_idx": -1, "ignored": 0}
        for name, (kind, full_shape) in self.tensors(n_full, k_full, full_groups).items():
            param = nn.Parameter(torch.empty(local[kind], dtype=dtypes[kind]), requires_grad=False)
            param.full_shape = full_shape
            param.dummy_value = dummies[kind]
            param.weight_loader = functools.partial(self._load, layer, kind)
            param.load_full = functools.partial(self._load, layer, kind, shard_id=None)
            layer.register_parameter(name, param)
            setattr(layer, f"int4_{kind}", name)
        # what the models ask their fast float paths about (takes_gemv(x, layer.weight)): an int dtype, which
        # no float kernel takes
        layer.register_buffer("weight", torch.empty(0, dtype=torch.int32), persistent=False)
        if not self.zero_point:
            layer.register_buffer("zeros", torch.full((k // group, n), 8, dtype=torch.uint8), persistent=False)

    def _load(self, layer: nn.Module, kind: str, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        """One checkpoint tensor (a packed part's where shard_id names it; all parts where None): this rank's
        slice, repacked into the kernels' layout."""
        if kind == "ignored":
            return
        if kind == "g_idx":
            rows = loaded.reshape(-1, 1).to(torch.int32)
        else:
            rows = self.values(kind, loaded)
        if layer.split_dim == 1 and layer.tp.size > 1:  # this rank's input features (or their groups)
            if kind in ("q", "g_idx"):
                rows = rows.narrow(0, layer.tp.rank * layer.in_features, layer.in_features)
            elif self.group_size != -1:
                size = layer.in_features // layer.group_size
                rows = rows.narrow(0, layer.tp.rank * size, size)
        if kind == "g_idx":
            if getattr(param, "loaded", False) and not torch.equal(param.data, rows.reshape(-1).to(param.device)):
                raise ValueError(f"the {self.name} checkpoint gives the parts of one packed projection (q/k/v or "
                                 "gate/up) different g_idx; the engine runs them as one projection of one order")
            param.data.copy_(rows.reshape(-1))
            param.loaded = True
            return
        parts = range(len(layer.part_sizes)) if shard_id is None else [layer.part_index(shard_id)]
        column = 0
        for part in parts:
            full, size = layer.part_sizes[part], layer.local_sizes[part]
            piece = rows.narrow(1, column, full) if shard_id is None else rows
            column += full
            if layer.split_dim == 0:
                piece = piece.narrow(1, layer.tp.rank * size, size)
            if kind == "q":
                piece = pack_int4(piece, 0)
            first = sum(layer.local_sizes[:part])
            param.data.narrow(1, first, size).copy_(piece)

    def after_loading(self, layer: nn.Module) -> None:
        """zeros as uint8, scales in fp16 where that is exact (else float32); desc_act's rows in group order."""
        if self.zero_point:
            zeros = getattr(layer, layer.int4_z)
            layer.register_buffer("zeros", zeros.data.to(torch.uint8), persistent=False)
            zeros.data = torch.empty(0, dtype=zeros.dtype, device=zeros.device)
        scales = getattr(layer, layer.int4_s)
        if torch.equal(scales.data.half().float(), scales.data):
            scales.data = scales.data.half()
        qweight = getattr(layer, layer.int4_q)
        perm = None
        if getattr(layer, "int4_g_idx", None):
            g_idx = getattr(layer, layer.int4_g_idx).data
            if not bool((g_idx == -1).all()):  # dummy weights: in order
                perm = group_order(g_idx, layer.group_size)
        if perm is not None:
            qweight.data = pack_int4(unpack_int4(qweight.data, 0)[perm], 0)
        layer.register_buffer("perm", perm, persistent=False)

    # ---- the product -----------------------------------------------------------------------------------

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if layer.perm is not None:
            x = x.index_select(-1, layer.perm)
        qweight, scales = getattr(layer, layer.int4_q), getattr(layer, layer.int4_s)
        kernels = _kernels_for(x, None, "int4_gemm")
        if kernels is not None:
            return kernels.int4_linear(x, qweight, scales, layer.zeros, layer.group_size, bias)
        return F.linear(x, dequantize(qweight, scales, layer.zeros, x.dtype).t(), bias)


class AwqMethod(Int4Method):
    """AutoAWQ's `quant_method: "awq"`, version gemm: {bits 4, group_size, zero_point true, modules_to_not_convert}."""

    name = "awq"

    def __init__(self, config: dict):
        bits, version = config.get("bits", config.get("w_bit")), str(config.get("version", "gemm")).lower()
        if bits != 4 or version != "gemm":
            raise ValueError(f"awq {bits}-bit version {version!r} is not supported; supported: 4-bit, version gemm")
        if not config.get("zero_point", True):
            raise ValueError("awq without zero points (zero_point false) is not supported; supported: zero_point true")
        super().__init__(config, int(config.get("group_size", config.get("q_group_size", 128))))
        self.not_converted = list(config.get("modules_to_not_convert") or [])

    def tensors(self, n, k, groups):
        return {"qweight": ("q", (k, n // 8)), "qzeros": ("z", (groups, n // 8)), "scales": ("s", (groups, n))}

    def values(self, kind, loaded):
        return loaded if kind == "s" else awq_unpack(loaded)


class GptqMethod(Int4Method):
    """`quant_method: "gptq"` (AutoGPTQ, GPTQModel, optimum): {bits 4, group_size, desc_act, sym,
    checkpoint_format "gptq" (zeros stored minus one) or "gptq_v2"}."""

    name = "gptq"

    def __init__(self, config: dict):
        if config.get("bits") != 4:
            raise ValueError(f"gptq {config.get('bits')}-bit checkpoints are not supported; supported: 4-bit")
        fmt = str(config.get("checkpoint_format") or "gptq")
        if fmt not in ("gptq", "gptq_v2"):
            raise ValueError(f"gptq checkpoint_format {fmt!r} is not supported; supported: gptq, gptq_v2")
        super().__init__(config, int(config.get("group_size", 128)))
        self.zero_offset = 1 if fmt == "gptq" else 0
        self.desc_act = bool(config.get("desc_act", False))
        self.not_converted = list(config.get("modules_to_not_convert") or [])

    def tensors(self, n, k, groups):
        return {"qweight": ("q", (k // 8, n)), "qzeros": ("z", (groups, n // 8)), "scales": ("s", (groups, n)),
                "g_idx": ("g_idx", (k,))}

    def values(self, kind, loaded):
        if kind == "q":
            return unpack_int4(loaded, 0)
        if kind == "z":
            return unpack_int4(loaded, -1).to(torch.int32) + self.zero_offset
        return loaded


class CompressedTensorsInt4Method(Int4Method):
    """compressed-tensors' pack-quantized: its config group's weights {num_bits 4, type int, strategy group
    (group_size) or channel, symmetric or not}, activations unquantized; `ignore`d modules stay float."""

    name = "compressed-tensors"

    def __init__(self, config: dict):
        weights, inputs = single_config_group(config)
        if (weights.get("num_bits"), weights.get("type")) != (4, "int") or inputs is not None:
            raise ValueError(f"compressed-tensors pack-quantized weights of {weights.get('num_bits')} bits, type "
                             f"{weights.get('type')!r} with input activations {'quantized' if inputs else 'none'} "
                             "are not supported; supported: 4-bit int weights, float activations (W4A16)")
        strategy = weights.get("strategy")
        if strategy not in ("group", "channel") or weights.get("actorder"):
            raise ValueError(f"compressed-tensors int4 strategy {strategy!r} (actorder {weights.get('actorder')!r}) "
                             "is not supported; supported: group or channel, without actorder")
        super().__init__(config, int(weights.get("group_size") or 0) if strategy == "group" else -1)
        self.zero_point = not weights.get("symmetric", True)
        self.not_converted = list(config.get("ignore") or [])

    def tensors(self, n, k, groups):
        names = {"weight_packed": ("q", (n, k // 8)), "weight_scale": ("s", (n, groups)),
                 "weight_shape": ("ignored", (2,))}
        if self.zero_point:
            names["weight_zero_point"] = ("z", (n // 8, groups))
        return names

    def values(self, kind, loaded):
        if kind == "q":
            return unpack_int4(loaded, -1).t()
        if kind == "z":
            return unpack_int4(loaded, 0).t()
        return loaded.t()
