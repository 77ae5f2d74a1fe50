"""Fused elementwise chains on CUDA; plain eager torch elsewhere.

RMSNorm (with the residual add; Gemma's scales by 1 + weight), the gated activations (SiLU·mul, GELU-tanh·mul)
and logit soft-capping run as the engine's Triton kernels (engine/kernels/norm_act.py), and so do the projections
of small decode batches (engine/kernels/gemv.py), which take the norm or the activation before them into their
prologue;
the other chains are compiled by torch.compile once (dynamic shapes) the first time they see a CUDA
tensor. Inside `with PlainTorch():` everything stays eager PyTorch (no Triton kernel, no torch.compile): the
model runner enters it for an engine built with fused_layers=False (EngineConfig), tests for a reference of
eager ops.
"""
from __future__ import annotations

import contextvars
import functools
import importlib

import torch
import torch.nn.functional as F

# True inside PlainTorch(): a context variable, so that engines in one process keep their own
_PLAIN_TORCH = contextvars.ContextVar("redline_plain_torch", default=False)


class PlainTorch:
    """Context manager (reusable, reentrant): the functions here take their eager PyTorch path inside it."""

    def __init__(self):
        self._tokens: list[contextvars.Token] = []

    def __enter__(self) -> None:
        self._tokens.append(_PLAIN_TORCH.set(True))

    def __exit__(self, *exc) -> None:
        _PLAIN_TORCH.reset(self._tokens.pop())


def fused(fn):
    compiled = None

    def run(x: torch.Tensor, *args):
        nonlocal compiled
        if x.is_cuda and not _PLAIN_TORCH.get():
            if compiled is None:
                # round where eager torch rounds, so fused and eager results agree bit for bit in bf16
                compiled = torch.compile(fn, dynamic=True, options={"emulate_precision_casts": True})
            return compiled(x, *args)
        return fn(x, *args)

    run.__doc__ = fn.__doc__
    return run


@functools.cache
def _kernel_module(name: str):
    """engine.kernels.<name>, or None where triton is missing."""
    try:
        return importlib.import_module(f"engine.kernels.{name}")
    except ImportError:
        return None


def _kernels_for(x: torch.Tensor, weight: torch.Tensor | None = None, name: str = "norm_act"):
    """The Triton kernel module `name` if its kernels apply to x (CUDA, outside PlainTorch, weight of x's
    dtype), else None."""
    if not x.is_cuda or _PLAIN_TORCH.get():
        return None
    if weight is not None and weight.dtype != x.dtype:
        return None
    return _kernel_module(name)


def _gemv_for(x: torch.Tensor, weight: torch.Tensor):
    """engine.kernels.gemv where it takes these rows (few, on CUDA), else None."""
    kernels = _kernels_for(x, weight, "gemv")
    return kernels if kernels is not None and kernels.takes(x, weight) else None


def takes_gemv(rows: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether a projection by `weight` of an input with rows' row count, dtype and device runs in the GEMV
    (rows: the input, or the projection's output, which has the same rows)."""
    return _gemv_for(rows, weight) is not None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool = False) -> torch.Tensor:
    """RMSNorm over the last dimension in float32; unit_offset: scaled by 1 + weight, rounded once (Gemma's)."""
    kernels = _kernels_for(x, weight)
    if kernels is not None:
        return kernels.rms_norm(x, weight, eps, unit_offset=unit_offset)
    return _normed(x, weight, eps, unit_offset)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                 unit_offset: bool = False):
    """(rms_norm(x + residual), x + residual)."""
    kernels = _kernels_for(x, weight)
    if kernels is not None:
        return kernels.rms_norm(x, weight, eps, residual=residual, unit_offset=unit_offset)
    residual = x + residual
    return _normed(residual, weight, eps, unit_offset), residual


def _normed(x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool) -> torch.Tensor:
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if unit_offset:
        return (h * (1.0 + weight.float())).to(dtype)
    return weight * h.to(dtype)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear; a few rows on CUDA (decode) go through the engine's GEMV, which streams the weight
    while the kernels before it finish (engine/kernels/gemv.py)."""
    kernels = _gemv_for(x, weight)
    if kernels is not None:
        return kernels.gemv(x, weight, bias)
    if bias is None:
        tma = _tma_for(x, weight)
        if tma is not None:
            return tma.tma_linear(x, weight)
    return F.linear(x, weight, bias)


def _tma_for(x: torch.Tensor, weight: torch.Tensor):
    """engine.kernels.tma_gemm where it takes these rows (a decode batch of 24-64 rows on a Hopper GPU), else
    None."""
    kernels = _kernels_for(x, weight, "tma_gemm")
    return kernels if kernels is not None and kernels.takes(x, weight) else None


def takes_gated_tma(rows: torch.Tensor, gate_up_weight: torch.Tensor) -> bool:
    """Whether the gate/up projection of an input with rows' row count, dtype and device runs in the TMA GEMM,
    which then gives silu(gate) * up itself (add_rms_norm_linear(..., gated=True))."""
    return _tma_for(rows, gate_up_weight) is not None


def add_rms_norm_linear(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                        weight: torch.Tensor, bias: torch.Tensor | None = None, gated: bool = False,
                        unit_offset: bool = False):
    """(linear(rms_norm(x + residual) x norm_weight, weight, bias), x + residual); without a residual (the
    first layer), the norm of x and x itself. Where the GEMV takes the rows, the residual add and the norm
    run in its prologue instead of a kernel of their own. gated (where takes_gated_tma): the weight is
    [gate | up], and the first result is silu(gate) * up, computed in the TMA GEMM's epilogue. unit_offset:
    the norm scales by 1 + norm_weight (Gemma's)."""
    if gated:
        tma = _tma_for(x, weight) if bias is None else None
        if tma is None:
            raise ValueError("add_rms_norm_linear(gated=True) needs rows the TMA GEMM takes, and no bias")
    kernels = None if gated else _gemv_for(x, weight)
    if (kernels is not None and norm_weight.dtype == x.dtype and norm_weight.is_contiguous()
            and (residual is None or (residual.shape == x.shape and residual.dtype == x.dtype
                                      and residual.stride(1) == 1))):
        if residual is None:
            return kernels.gemv(x, weight, bias, norm=(None, norm_weight, eps), unit_offset=unit_offset), x
        return kernels.gemv(x, weight, bias, norm=(residual, norm_weight, eps), unit_offset=unit_offset)
    if residual is None:
        normed, residual = rms_norm(x, norm_weight, eps, unit_offset), x
    else:
        normed, residual = add_rms_norm(x, residual, norm_weight, eps, unit_offset)
    if gated:
        return tma.tma_linear(normed, weight, gated=True), residual
    return linear(normed, weight, bias), residual


def act_and_mul_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                       act: str = "silu") -> torch.Tensor:
    """linear(act_and_mul(x, act), weight, bias); where the GEMV takes the rows, the activation is computed in
    its prologue instead of a kernel of their own."""
    kernels = _gemv_for(x, weight)
    if kernels is not None:
        return kernels.gemv(x, weight, bias, gated=True, act=act)
    return linear(act_and_mul(x, act), weight, bias)


GATE_ACTS = {"silu": F.silu, "gelu_tanh": functools.partial(F.gelu, approximate="tanh")}


def act_and_mul(x: torch.Tensor, act: str = "silu") -> torch.Tensor:
    """act(gate) * up over a packed [gate | up] last dimension: act "silu" (SwiGLU) or "gelu_tanh" (GeGLU with
    GELU's tanh approximation)."""
    kernels = _kernels_for(x)
    if kernels is not None:
        return kernels.act_and_mul(x, act)
    gate, up = x.chunk(2, -1)
    return GATE_ACTS[act](gate) * up


def soft_cap(x: torch.Tensor, cap: float) -> torch.Tensor:
    """cap x tanh(x / cap), elementwise (Gemma 2's final-logit soft-capping); on CUDA in place, in one kernel."""
    kernels = _kernels_for(x)
    if kernels is not None and x.dim() == 2 and x.stride(1) == 1:
        return kernels.soft_cap(x, cap)
    return torch.tanh(x / cap) * cap


def embedding(input_ids: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    """F.embedding, times scale (a 0-dim tensor of weight's dtype: Gemma's sqrt(hidden_size)) where given;
    the lookup and the product compiled into one kernel on CUDA."""
    if scale is None:
        return F.embedding(input_ids, weight)
    return _scaled_embedding(input_ids, weight, scale)


@fused
def _scaled_embedding(input_ids: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return F.embedding(input_ids, weight) * scale


@fused
def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding over the two halves of the last dimension; cos/sin broadcast over heads."""
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
