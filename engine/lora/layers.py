"""The device side of LoRA: a pool of max_loras slots of adapter weights for every projection an adapter may
target, and the per-step rows of each slot.

Each such projection gets a LoRALinear as its `lora` (engine/layers/linear.py calls it): A [slots, parts x R,
in] and B [slots, out, parts x R] with R = max_lora_rank, zero where an adapter has no part or a smaller rank,
so a packed projection (qkv, gate/up) applies each part's adapter to that part's output columns. Under tensor
parallelism a column-parallel projection keeps its rank's rows of B, a row-parallel one its rank's columns of
A (its output is a partial sum, like the base product's)."""
from __future__ import annotations

import torch
from torch import nn

from engine.layers.fusion import _kernels_for, act_and_mul
from engine.lora.adapter import Adapter, load_adapter

# the engine projections an adapter's checkpoint modules land in (LlamaForCausalLM.packed_modules)
LORA_PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


class LoRALinear:
    """One projection's slots; add(x, out) adds each row's adapter product to out (rows of no slot: none)."""

    def __init__(self, pool: "LoRAPool", layer: nn.Module, row_parallel: bool):
        self.pool, self.row_parallel = pool, row_parallel
        rank, slots = pool.max_rank, pool.max_loras
        # this rank's features (a quantized layer has no .weight)
        out_features, in_features = layer.out_features, layer.in_features
        self.num_parts = 1 if row_parallel else len(layer.part_sizes)
        width = self.num_parts * rank
        kw = dict(dtype=pool.dtype, device=pool.device)
        self.a = torch.zeros(slots, width, in_features, **kw)
        self.b = torch.zeros(slots, out_features, width, **kw)
        self.layer = layer

    @property
    def active(self) -> bool:
        """Whether this step has rows under an adapter (else the projection runs as without LoRA)."""
        return self.pool.active

    def add(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """out += each row's x @ A[slot]^T @ B[slot]^T (in place): the engine's Triton shrink/expand kernels on
        CUDA (engine/kernels/lora.py), torch products per slot elsewhere and inside PlainTorch."""
        kernels = self._kernels(x, out)
        if kernels is not None:
            return kernels.lora_add(x, out, self.a, self.b, self.pool.tiles)
        if self.pool.tiles is not None and not self.pool.groups:  # a decode graph's tiles: the kernels only
            raise RuntimeError("a LoRA decode graph needs the engine's LoRA kernels (CUDA, fused_layers=True)")
        for slot, rows in self.pool.groups:
            rows_x = x.index_select(0, rows)
            delta = (rows_x @ self.a[slot].T) @ self.b[slot].T
            out.index_add_(0, rows, delta.to(out.dtype))
        return out

    def add_normed(self, h: torch.Tensor, out: torch.Tensor, norm) -> torch.Tensor:
        """add() of `norm`(h): for a projection whose own kernel took the norm into its prologue, the shrink
        kernel takes it into its own (h: the residual sum the norm reads; norm: an RMSNorm)."""
        kernels = self._kernels(h, out)
        if kernels is not None and norm.weight.dtype == h.dtype:
            return kernels.lora_add(h, out, self.a, self.b, self.pool.tiles,
                                    norm=(norm.weight, norm.eps, norm.unit_offset))
        return self.add(norm(h), out)

    def add_activated(self, gate_up: torch.Tensor, out: torch.Tensor, act: str) -> torch.Tensor:
        """add() of act(gate) x up of packed [gate | up] rows: for a projection whose own kernel computed the
        activation in its prologue, the shrink kernel does too (SiLU)."""
        kernels = self._kernels(gate_up, out) if act == "silu" else None
        if kernels is not None:
            return kernels.lora_add(gate_up, out, self.a, self.b, self.pool.tiles, silu_and_mul=True)
        return self.add(act_and_mul(gate_up, act), out)

    def _kernels(self, x: torch.Tensor, out: torch.Tensor):
        """engine.kernels.lora where its kernels take these rows (CUDA, the pool's tiles, rows contiguous)."""
        if self.pool.tiles is None or x.dim() != 2 or x.stride(1) != 1 or out.stride(1) != 1:
            return None
        return _kernels_for(x, None, "lora")

    def load(self, slot: int, parts: list, tp_rank: int) -> None:
        """Slot `slot` := these LoRAParts (none: zeros, the adapter leaves this projection alone)."""
        self.a[slot].zero_()
        self.b[slot].zero_()
        rank = self.pool.max_rank
        layer = self.layer
        for p in parts:
            r = p.a.shape[0]
            if self.row_parallel:  # this rank's input columns of A
                local_in = self.a.shape[2]
                self.a[slot, :r].copy_(p.a[:, tp_rank * local_in:(tp_rank + 1) * local_in])
                self.b[slot, :, :r].copy_(p.b)
                continue
            index = layer.SHARDS.get(p.part, p.part) if hasattr(layer, "SHARDS") else p.part
            offset, size = layer._local_slice(index)
            cols = slice(index * rank, index * rank + r)
            self.a[slot, cols].copy_(p.a)
            self.b[slot, offset:offset + size, cols].copy_(p.b[tp_rank * size:(tp_rank + 1) * size])


class LoRAPool:
    """The slots of every LoRA projection of a model; the runner loads adapters into slots (from host copies
    read once from disk) and sets each step's rows per slot before the forward pass."""

    def __init__(self, model: nn.Module, max_loras: int, max_rank: int, dtype: torch.dtype, device: torch.device,
                 tp_rank: int = 0):
        from engine.layers.linear import ColumnParallelLinear, RowParallelLinear

        self.max_loras, self.max_rank, self.tp_rank = max_loras, max_rank, tp_rank
        self.dtype, self.device = dtype, device  # the model's activations'
        self.packed_modules = getattr(model, "packed_modules", {})
        self.groups: list[tuple[int, torch.Tensor]] = []  # this step's (slot, its input rows on the device)
        self.tiles = None  # on CUDA, the same rows as the kernels take them (engine/kernels/lora.py's LoRATiles)
        self.active = False  # this step (or the decode graph being captured) has rows under an adapter
        self.layers: dict[str, LoRALinear] = {}
        for name, module in model.named_modules():
            # the decoder layers' projections (adapter.check_adapter names the same ones)
            if (name.startswith("model.layers.") and name.rsplit(".", 1)[-1] in LORA_PROJECTIONS
                    and isinstance(module, (ColumnParallelLinear, RowParallelLinear))):
                module.lora = self.layers[name] = LoRALinear(self, module, isinstance(module, RowParallelLinear))
        self.host: dict[int, Adapter] = {}  # adapters read from disk, by int_id

    def apply_loads(self, loads: list[tuple[int, int, str, str]]) -> None:
        """A step's adapters into their slots (StepInputs.lora_loads), before its forward pass."""
        for slot, int_id, name, path in loads:
            self.load(slot, int_id, name, path)

    def use_tiles(self, tiles) -> None:
        """Capturing a decode graph: the kernels read the rows from these static buffers (None: done)."""
        self.groups, self.tiles, self.active = [], tiles, tiles is not None

    def load(self, slot: int, int_id: int, name: str, path: str) -> None:
        adapter = self.host.get(int_id)
        if adapter is None:
            adapter = self.host[int_id] = load_adapter(name, path, self.max_rank, self.packed_modules)
        for layer_name, layer in self.layers.items():
            layer.load(slot, adapter.modules.get(layer_name, []), self.tp_rank)

    def set_rows(self, slot_ids: torch.Tensor | None, device: torch.device) -> None:
        """This step's rows of each slot, from the step's slot per input row (-1: the base model)."""
        self.groups, self.tiles, self.active = [], None, slot_ids is not None
        if slot_ids is None:
            return
        for slot in sorted(set(slot_ids.tolist()) - {-1}):
            rows = torch.nonzero(slot_ids == slot).flatten()
            self.groups.append((slot, rows.to(device)))
        if device.type == "cuda" and self.groups:
            from engine.kernels.lora import LoRATiles, make_tiles

            order, slots, starts, ends = make_tiles(slot_ids)
            packed = torch.tensor(order + slots + starts + ends, dtype=torch.int32).pin_memory()
            packed = packed.to(device, non_blocking=True)
            self.tiles = LoRATiles(*packed.split([len(order), len(slots), len(starts), len(ends)]))
