"""Host buffers for a step's copies between host and device, reused so that a step allocates nothing."""
from __future__ import annotations

import torch


class PinnedRing:
    """A ring of host buffers, pinned where the device is a GPU (a copy from or to one is asynchronous).
    take() hands out the next one, which first waits for the copy that last used it: that copy was queued
    RING - 1 takes ago, and a step has at most two copies in flight, so the wait is over before it begins."""

    RING = 4

    def __init__(self, device: torch.device):
        self.device = device
        self._buffers: list[torch.Tensor | None] = [None] * self.RING
        self._copied: list[torch.cuda.Event | None] = [None] * self.RING
        self._next = 0
        self._stream = None  # the stream the copies are queued on, looked up once (a lookup is a few µs)

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> tuple[int, torch.Tensor]:
        """(slot, a host tensor of that shape and dtype in it), free to write or to copy into."""
        i, self._next = self._next, (self._next + 1) % self.RING
        if self._copied[i] is not None:
            self._copied[i].synchronize()
        count = 1
        for size in shape:
            count *= size
        num_bytes = count * dtype.itemsize
        buffer = self._buffers[i]
        if buffer is None or buffer.numel() < num_bytes:
            grown = max(num_bytes, 2 * buffer.numel() if buffer is not None else 0)
            buffer = self._buffers[i] = torch.empty(grown, dtype=torch.uint8, pin_memory=self.device.type == "cuda")
        return i, buffer[:num_bytes].view(dtype).view(shape)

    def copied(self, i: int) -> torch.cuda.Event | None:
        """Mark the copy just queued from or into slot i: the event it completes at (None on a CPU)."""
        if self.device.type != "cuda":
            return None
        event = self._copied[i] or torch.cuda.Event()
        self._stream = self._stream or torch.cuda.current_stream(self.device)
        event.record(self._stream)
        self._copied[i] = event
        return event
