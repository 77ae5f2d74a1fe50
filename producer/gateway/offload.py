"""Work that would hold the event loop (parsing a large body, validating a job, compiling a schema's grammar,
reading a batch file), run on a few threads so /healthz and every other request are still answered."""
from __future__ import annotations

from typing import Callable, TypeVar

import anyio

T = TypeVar("T")

# requests parsed or validated at once: a 12k-property schema takes seconds to check, and more threads
# than cores would only slow each other down; the rest wait their turn without holding the loop
OFFLOAD_THREADS = 4


class Offload:
    """One gateway's pool: `await offload(fn, *args)` runs fn(*args) on one of OFFLOAD_THREADS threads."""

    def __init__(self) -> None:
        self.limiter = anyio.CapacityLimiter(OFFLOAD_THREADS)

    async def __call__(self, fn: Callable[..., T], *args) -> T:
        return await anyio.to_thread.run_sync(fn, *args, limiter=self.limiter)
