"""Programmatic dependent launch (PDL) for the decode path's kernels.

A decode step is a chain of short kernels. Launched with PDL (compute capability 9.0 and later), a kernel
may start while the kernel before it on the stream still runs, once every program of that kernel has
called `launch_dependents`. The engine's kernels call it first thing, load what no earlier kernel writes
(weights), then `wait_for_previous`: it returns once the previous kernel has completed and its writes are
visible (so, through its own wait, every kernel before it). Nothing is written before the wait. So the
results are those of plain stream order, while the next kernel's launch and its weight reads overlap the
kernel before it. CUDA graphs capture the launches as programmatic edges. A kernel launched without PDL
after one of these simply starts once it has completed.

Used on GPUs of compute capability 9.0 and later (never under the Triton interpreter or on CPU): with it the
batch-1 bench went from 800 to 910 tok/s on the H100 (16f3d7f).
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from engine.kernels.common import interpreted

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # a Triton without grid dependency control: kernels are never launched with PDL
    gdc_launch_dependents = gdc_wait = None


@triton.jit
def launch_dependents(PDL: tl.constexpr):
    """Let the next kernel on the stream start (its own wait_for_previous keeps it in order)."""
    if PDL:
        gdc_launch_dependents()


@triton.jit
def wait_for_previous(PDL: tl.constexpr):
    """Wait until the previous kernel on the stream has completed and its writes are visible."""
    if PDL:
        gdc_wait()


@functools.cache
def device_has_pdl(device_index: int) -> bool:
    """Whether kernels on this GPU launch with PDL: compute capability 9.0 or later, compiled (not interpreted)."""
    if interpreted() or gdc_wait is None:
        return False
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def pdl_options(t: torch.Tensor) -> dict:
    """Launch options for a kernel written with launch_dependents / wait_for_previous(PDL): PDL and
    launch_pdl together where the device allows it, else PDL=False."""
    on = t.is_cuda and device_has_pdl(
        t.device.index if t.device.index is not None else torch.cuda.current_device())
    return {"PDL": True, "launch_pdl": True} if on else {"PDL": False}
