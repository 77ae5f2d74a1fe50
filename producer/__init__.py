"""Producer side of the queue: the wire contract (protocol), clients, and the embedded Redis."""
from .aio import AsyncClient
from .client import Client
from .protocol import JobResult, JobSpec, JobStatus, Keys, Sampling, TokenDelta

__all__ = ["Client", "AsyncClient", "JobResult", "JobSpec", "JobStatus", "Keys", "Sampling", "TokenDelta"]
