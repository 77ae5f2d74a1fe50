"""Programmatic dependent launch (PDL) for the engine's own kernels.

A decode step is a chain of short kernels; between two of them the GPU drains one grid, then fetches and
schedules the next. Launched with PDL (Hopper and later), a kernel is scheduled while the kernel before it
on the stream is still finishing, and its first instruction, `wait_for_previous`, blocks until that kernel
has completed and its writes are visible. Nothing is read or written before the wait, so the results are
those of plain stream order; what overlaps is the next kernel's launch with the previous kernel's tail.
CUDA graphs capture the launches as programmatic edges.

REDLINE_PDL: "1" (on GPUs of compute capability 9.0 and later; never under the Triton interpreter or on
CPU) or "0", the default.
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl


@triton.jit
def wait_for_previous(PDL: tl.constexpr):
    """First statement of a kernel launched with pdl_options(): wait for the previous kernel."""
    if PDL:
        tl.extra.cuda.gdc_wait()


def pdl_setting() -> bool:
    value = os.environ.get("REDLINE_PDL", "0")
    if value not in ("0", "1"):
        raise ValueError(f"REDLINE_PDL must be 0 or 1, got {value!r}")
    return value == "1"


@functools.cache
def _pdl_on(device_index: int) -> bool:
    if os.environ.get("TRITON_INTERPRET") == "1":
        return False
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def pdl_options(t: torch.Tensor) -> dict:
    """Launch options for a kernel that starts with wait_for_previous(PDL): PDL and launch_pdl together."""
    on = pdl_setting() and t.is_cuda and _pdl_on(t.device.index if t.device.index is not None else
                                               torch.cuda.current_device())
    return {"PDL": True, "launch_pdl": True} if on else {"PDL": False}
