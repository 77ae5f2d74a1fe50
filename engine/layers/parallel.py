"""Which tensor-parallel rank a layer lives on, passed to layers explicitly (no process globals)."""
from __future__ import annotations

import threading
import warnings
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F

from engine.layers.fusion import add_rms_norm, linear

# all-reduces (a decode step's) go through the one-shot kernel up to this size: a Qwen3-8B decode step of 256
# sequences moves 2 MB a call; prefill steps of more than 1,024 rows at hidden 4096 go past it
ONE_SHOT_MAX_BYTES = 8 << 20
# row-parallel projections of at least this many rows (prefill steps) whose sum is too large for the one-shot
# kernel have it started beside their GEMM by the copy engines (CopyEngineSum)
LARGE_MIN_ROWS = 1024
CHUNK_ROW_MULTIPLE = 16
# row chunks of a row-parallel projection whose sum the copy engines carry: 4 measured 0.04 s faster on the
# 8B shape's TP=2 nano-bench, inside what one run tells (2x H200, f984691)
COPY_CHUNKS = 2


def _chunk_rows(rows: int, chunks: int) -> int:
    """Rows of each of (at most) `chunks` row chunks: a multiple of CHUNK_ROW_MULTIPLE."""
    step = -(-rows // chunks)
    return -(-step // CHUNK_ROW_MULTIPLE) * CHUNK_ROW_MULTIPLE


def _chunked_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor,
                    chunks: int):
    """F.linear(x, weight, bias) into out, row chunk by row chunk; yields (chunk index, first row, the
    chunk's rows of out) as soon as each chunk's GEMM is queued."""
    rows = x.shape[0]
    step = _chunk_rows(rows, chunks)
    for index, first in enumerate(range(0, rows, step)):
        part = out[first:first + step]
        if bias is None:
            torch.mm(x[first:first + step], weight.t(), out=part)
        else:
            torch.addmm(bias, x[first:first + step], weight.t(), out=part)
        yield index, first, part


class PushedSum:
    """A row-parallel projection's output whose peers' parts the copy engines are bringing in
    (CopyEngineSum.start); finish it with TPGroup.all_reduce_add_rms_norm, or wait() for the plain sum."""

    def __init__(self, owner: "CopyEngineSum", out: torch.Tensor, call: int, chunk_rows: int):
        self.owner, self.out, self.call, self.chunk_rows = owner, out, call, chunk_rows

    def wait(self) -> torch.Tensor:
        return self.owner.finish(self)


class CopyEngineSum:
    """All-reduce of a prefill step's large row-parallel outputs, carried by the copy engines under the
    GEMM (GPUs with symmetric memory).

    start() computes this rank's part in row chunks. After each chunk's GEMM a side stream copies the
    chunk (cudaMemcpyAsync: the copy engine, no SM taken from the next chunk's GEMM) into this rank's slot
    of every peer's buffer, then writes the call's number into the peer's flag for (chunk, this rank).
    finish() runs one kernel (engine/kernels/pushed_sum.py) that waits for each row's chunk from every
    peer, sums in rank order and, fused, adds the residual and normalises.

    Buffers: two generations of (world_size - 1) slots of `capacity` elements per rank; call k uses
    generation k % 2. A peer writes generation k % 2 again at call k + 2, after its GEMM of that call,
    which its stream runs after its own finish() of call k + 1, which waited for this rank's chunks of
    call k + 1, which this rank copied only after its finish() of call k had read the slots. So a slot is
    never overwritten while it is read, and every rank must make the same sequence of calls (they do:
    every rank runs the same forward passes).
    """

    def __init__(self, data, flags, peer_data: dict, peer_flags: dict, capacity: int, chunks: int,
                 rank: int, world_size: int, keep):
        self.data, self.flags = data, flags  # this rank's buffers (flags as int32 for the kernel)
        self.peer_data, self.peer_flags = peer_data, peer_flags  # {peer: its buffers as this rank maps them}
        self.capacity, self.chunks = capacity, chunks
        self.rank, self.world_size = rank, world_size
        self._keep = keep  # the rendezvous handles: peers map the buffers
        self.calls = 0
        # this rank's part of call k is computed into parts[k % 2]: the copy engine reads it after start()
        # returns, and it is overwritten only at call k + 2, after the peers' finish() of call k (which
        # needed all of it) let them send call k + 1, which this rank's finish() of k + 1 waited for. (A
        # fresh tensor each call, held for the side stream by record_stream, measured slower.)
        self.parts = torch.empty(2, capacity, dtype=data.dtype, device=data.device)
        self.stop = torch.zeros(1, dtype=torch.int32, device=data.device)
        self._one = torch.ones(1, dtype=torch.int32, pin_memory=True)
        self._copy_stream = torch.cuda.Stream(data.device)
        self._side_stream = torch.cuda.Stream(data.device)

    @classmethod
    def create(cls, device: torch.device, dtype: torch.dtype, rank: int, world_size: int,
               capacity: int, chunks: int) -> "CopyEngineSum | None":
        """Collective over the default group, after OneShotAllReduce.create agreed that every rank can
        use symmetric memory. None on every rank (with a warning) where any rank cannot allocate the
        buffers: the ranks agree before the rendezvous, which a rank that skipped it would hang."""
        import torch.distributed._symmetric_memory as symm_mem

        slots = world_size - 1
        try:
            data = symm_mem.empty(2 * slots * capacity, dtype=dtype, device=device)
            flags = symm_mem.empty(chunks * world_size, dtype=torch.uint32, device=device)
            flags.zero_()
            problem = None
        except Exception as e:  # noqa: BLE001 (out of memory, say: NCCL for the large all-reduces)
            problem = str(e)
        if not _every_rank_ready(problem, device):
            warnings.warn(f"copy-engine all-reduce unavailable ({problem or 'another rank could not set it up'}); "
                          "large all-reduces use NCCL")
            return None
        group_name = dist.group.WORLD.group_name
        data_handle = symm_mem.rendezvous(data, group_name)
        flags_handle = symm_mem.rendezvous(flags, group_name)
        peers = [q for q in range(world_size) if q != rank]
        peer_data = {q: data_handle.get_buffer(q, (data.numel(),), dtype) for q in peers}
        peer_flags = {q: flags_handle.get_buffer(q, (flags.numel(),), torch.uint32) for q in peers}
        torch.cuda.synchronize(device)
        dist.barrier()  # every rank's flags are zero before any rank writes one
        return cls(data, flags.view(torch.int32), peer_data, peer_flags, capacity, chunks, rank, world_size,
                   (data_handle, flags_handle, flags))

    def takes(self, numel: int, dtype: torch.dtype) -> bool:
        return dtype == self.data.dtype and numel <= self.capacity

    def slot_start(self, generation: int, sender: int, holder: int) -> int:
        """Where sender's slot starts in holder's buffer for one generation (holder's own is left out)."""
        return (generation * (self.world_size - 1) + sender - (1 if sender > holder else 0)) * self.capacity

    def start(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> PushedSum:
        """This rank's part F.linear(x, weight, bias), its chunks on their way to the peers."""
        self.calls += 1
        call, generation = self.calls, self.calls % 2
        rows, width = x.shape[0], weight.shape[0]
        out = self.parts[generation, :rows * width].view(rows, width)
        main = torch.cuda.current_stream(x.device)
        for chunk, first, part in _chunked_linear(x, weight, bias, out, self.chunks):
            self._copy_stream.wait_stream(main)
            with torch.cuda.stream(self._copy_stream):
                flat = part.reshape(-1)
                for q, buffer in self.peer_data.items():
                    begin = self.slot_start(generation, self.rank, q) + first * width
                    buffer[begin:begin + flat.numel()].copy_(flat)
                    torch.ops.symm_mem.stream_write_value32_(self.peer_flags[q], chunk * self.world_size + self.rank,
                                                             call)
        return PushedSum(self, out, call, _chunk_rows(rows, self.chunks))

    def _own_slots(self, call: int) -> torch.Tensor:
        """This rank's buffer for the call's generation: every peer's slot, in rank order."""
        size = (self.world_size - 1) * self.capacity
        return self.data[call % 2 * size:(call % 2 + 1) * size]

    def finish(self, pending: PushedSum, residual: torch.Tensor | None = None, weight: torch.Tensor | None = None,
               eps: float = 0.0) -> torch.Tensor:
        from engine.kernels.pushed_sum import pushed_sum

        # into a new tensor: the side stream may still be copying the part out of pending.out
        return pushed_sum(pending.out, self._own_slots(pending.call), self.flags, self.stop, pending.call,
                          pending.chunk_rows, self.rank, self.world_size, out=torch.empty_like(pending.out),
                          residual=residual, weight=weight, eps=eps)

    def stop_waits(self) -> None:
        """A peer died: make every waiting and later finish() return at once (see OneShotAllReduce)."""
        with torch.cuda.stream(self._side_stream):
            self.stop.copy_(self._one, non_blocking=True)


class OneShotAllReduce:
    """All-reduce of small tensors through symmetric memory (engine/kernels/all_reduce.py): each rank
    stores its part into a slot of every peer's buffer over NVLink, and every rank sums all parts in rank
    order in one kernel (identical sums on every rank), once they have arrived. Decode steps all-reduce
    a few MB twice a layer, where NCCL's fixed cost dominates. The kernel's waits poll a stop flag, so a
    dead peer cannot hang them."""

    def __init__(self, buffer: torch.Tensor, buf_ptrs: torch.Tensor, capacity: int, rank: int,
                 world_size: int, keep):
        from engine.kernels.all_reduce import PROGRAMS

        self.buffer, self.buf_ptrs = buffer, buf_ptrs
        self.rank, self.world_size = rank, world_size
        self.slot_capacity = capacity  # elements of one rank's part
        self._keep = keep  # the rendezvous handle: peers map the buffer
        self.programs = PROGRAMS  # every call of every rank launches as many programs
        self.state = torch.zeros(self.programs, dtype=torch.int32, device=buffer.device)  # calls so far
        self.stop = torch.zeros(1, dtype=torch.int32, device=buffer.device)
        self._one = torch.ones(1, dtype=torch.int32, pin_memory=True)
        self._side_stream = torch.cuda.Stream(buffer.device)

    @classmethod
    def create(cls, device: torch.device, dtype: torch.dtype, rank: int, world_size: int,
               max_bytes: int = ONE_SHOT_MAX_BYTES) -> "OneShotAllReduce | None":
        """Collective over the default group; None on every rank (with a warning) where any rank cannot use
        symmetric memory: the ranks agree first, since a rank that skipped the rendezvous would leave the
        others waiting in it forever."""
        from engine.kernels.all_reduce import buffer_elements, clear_buffer  # Triton is optional: import on use

        problem = _symmetric_memory_problem(device, rank, world_size)
        if not _every_rank_ready(problem, device):
            warnings.warn(f"{problem or 'another tensor-parallel rank cannot use symmetric memory'}; this engine "
                          "uses NCCL for every all-reduce")
            return None
        try:
            import torch.distributed._symmetric_memory as symm_mem

            group_name = dist.group.WORLD.group_name
            if hasattr(symm_mem, "enable_symm_mem_for_group"):
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", FutureWarning)
                    symm_mem.enable_symm_mem_for_group(group_name)
            # slots of max_bytes, one per rank in each of the kernel's generations; larger all-reduces go
            # through the copy engines or NCCL
            capacity = max(1, max_bytes // dtype.itemsize)
            buffer = symm_mem.empty(buffer_elements(capacity, world_size), dtype=dtype, device=device)
            clear_buffer(buffer)
            buffers = symm_mem.rendezvous(buffer, group_name)
            buf_ptrs = torch.tensor(buffers.buffer_ptrs, dtype=torch.int64, device=device)
            torch.cuda.synchronize(device)
            dist.barrier()  # every rank's buffer is clear before any rank stores into it
        except Exception as e:  # noqa: BLE001 (any failure here means: use NCCL)
            warnings.warn(f"symmetric-memory all-reduce unavailable, using NCCL for every all-reduce: {e}")
            return None
        return cls(buffer, buf_ptrs, capacity, rank, world_size, buffers)

    def takes(self, numel: int, dtype: torch.dtype) -> bool:
        return dtype == self.buffer.dtype and numel <= self.slot_capacity

    def fits(self, x: torch.Tensor) -> bool:
        return self.takes(x.numel(), x.dtype) and x.is_contiguous()

    def fits_add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor) -> bool:
        """Whether add_rms_norm takes these: contiguous [rows, hidden] rows the kernel holds, one dtype."""
        from engine.kernels.all_reduce import MAX_HIDDEN

        return (self.fits(x) and x.dim() == 2 and x.shape[1] <= MAX_HIDDEN
                and residual.shape == x.shape and residual.dtype == x.dtype and residual.is_contiguous()
                and weight.shape == x.shape[1:] and weight.dtype == x.dtype and weight.is_contiguous())

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        from engine.kernels.all_reduce import one_shot_all_reduce

        flat = x.view(-1)  # in place: each program reads its share of x before it writes that share
        one_shot_all_reduce(flat, flat, self.buf_ptrs, self.state, self.stop, self.rank, self.world_size,
                            self.programs)
        return x

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(rms_norm(s + residual) × weight, s + residual) with s the sum of x over ranks, in one kernel;
        both in place: the normed rows over x, the new residual over residual."""
        from engine.kernels.all_reduce import one_shot_all_reduce_add_rms_norm

        one_shot_all_reduce_add_rms_norm(x, residual, weight, eps, x, self.buf_ptrs, self.state, self.stop,
                                         self.rank, self.world_size, self.programs)
        return x, residual

    def stop_waits(self) -> None:
        """A peer died: make every waiting and later call return at once (with meaningless sums). The flag
        is copied from a side stream by the copy engine, so it never queues behind the waiting kernels."""
        with torch.cuda.stream(self._side_stream):
            self.stop.copy_(self._one, non_blocking=True)


def _every_rank_ready(problem: str | None, device: torch.device) -> bool:
    """Whether no rank has a problem (collective over the default group: every rank must call it)."""
    agreed = torch.tensor([0 if problem else 1], dtype=torch.int32, device=device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
    return problem is None and bool(agreed.item())


def _symmetric_memory_problem(device: torch.device, rank: int, world_size: int) -> str | None:
    """Why this rank cannot set up symmetric memory for the default group, or None."""
    try:
        import torch.distributed._symmetric_memory as symm_mem
    except ImportError as e:
        return f"symmetric memory is not available in this PyTorch ({e})"
    if device.type == "cuda":  # rank q runs on GPU q; each must map every peer's memory (NVLink or PCIe P2P)
        blind = [q for q in range(world_size) if q != rank and not torch.cuda.can_device_access_peer(device, q)]
        if blind:
            return f"GPU {device.index} cannot access the memory of GPU(s) {blind} directly"
    if dist.group.WORLD.group_name in getattr(symm_mem, "_group_name_to_store", {}):
        # PyTorch binds a group name to its store for the process's life, and each new default group is
        # named "0" again: the name still points at an earlier engine's store, where a rendezvous would
        # wait forever
        return ("symmetric memory was set up for an earlier tensor-parallel engine in this process (start "
                "engines in processes of their own to keep it)")
    return None


@dataclass(frozen=True)
class TPGroup:
    rank: int = 0
    size: int = 1
    one_shot: OneShotAllReduce | None = field(default=None, compare=False, repr=False)
    # set on rank 0 when a peer's process exited: no collective may be queued after that, since it would
    # wait for the dead peer (and could queue behind the communicator's abort)
    peer_exited: threading.Event | None = field(default=None, compare=False, repr=False)
    pushed: CopyEngineSum | None = field(default=None, compare=False, repr=False)

    def _check_peers(self) -> None:
        if self.peer_exited is not None and self.peer_exited.is_set():
            raise RuntimeError("a tensor-parallel rank exited: no further collective is queued")

    def stop_peer_waits(self) -> None:
        """A peer died: release this rank's kernels waiting on it, where a communicator abort cannot."""
        if self.one_shot is not None:
            self.one_shot.stop_waits()
        if self.pushed is not None:
            self.pushed.stop_waits()

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of `x` over ranks (may be computed in place, or into a new tensor: use the result)."""
        if self.size > 1:
            self._check_peers()
            if self.one_shot is not None and self.one_shot.fits(x):
                return self.one_shot(x)
            dist.all_reduce(x)
        return x

    def is_plain_product(self, x: torch.Tensor) -> bool:
        """Whether partial_linear of x is a plain F.linear with nothing started beside it: one rank, decode
        rows, or a CUDA graph being captured."""
        return (self.size == 1 or x.dim() != 2 or x.shape[0] < LARGE_MIN_ROWS
                or (x.is_cuda and torch.cuda.is_current_stream_capturing()))

    def partial_linear(self, x: torch.Tensor, weight: torch.Tensor,
                       bias: torch.Tensor | None) -> "torch.Tensor | PushedSum":
        """This rank's part of a row-parallel projection, F.linear(x, weight, bias), for a later
        all_reduce(_add_rms_norm) to sum over ranks. Where that sum is too large for the one-shot kernel
        and x has at least LARGE_MIN_ROWS rows, the copy engines start it here, chunk by chunk (a
        PushedSum), where the ranks share symmetric memory. Never while a CUDA graph is being captured
        (decode steps, which the one-shot kernel sums)."""
        if self.is_plain_product(x):
            return linear(x, weight, bias)
        rows = x.shape[0]
        if self.one_shot is not None and self.one_shot.takes(rows * weight.shape[0], x.dtype):
            return F.linear(x, weight, bias)
        if self.pushed is not None and self.pushed.takes(rows * weight.shape[0], x.dtype):
            self._check_peers()
            return self.pushed.start(x, weight, bias)
        return F.linear(x, weight, bias)

    def all_reduce_add_rms_norm(self, x: "torch.Tensor | PushedSum", residual: torch.Tensor,
                                weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """add_rms_norm (engine/layers/fusion.py) of the sum of `x` over ranks: (normed rows, new residual).
        x and residual may be overwritten: use the results. One kernel through symmetric memory where it
        fits; x may also be a PushedSum (partial_linear), whose sum is on its way and is finished fused
        with the residual add and the norm, in one kernel."""
        if isinstance(x, PushedSum):
            self._check_peers()
            if residual.shape == x.out.shape and residual.is_contiguous() and weight.is_contiguous():
                return x.owner.finish(x, residual, weight, eps), residual
            return add_rms_norm(x.wait(), residual, weight, eps)
        if self.size > 1:
            self._check_peers()
            if self.one_shot is not None and self.one_shot.fits_add_rms_norm(x, residual, weight):
                return self.one_shot.add_rms_norm(x, residual, weight, eps)
            x = self.all_reduce(x)
        return add_rms_norm(x, residual, weight, eps)

    def broadcast_from_rank0(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's `x` on every rank (the others pass a buffer of the same shape)."""
        if self.size > 1:
            self._check_peers()
            dist.broadcast(x, src=0)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's `x`, stacked in rank order: [size, *x.shape]."""
        if self.size == 1:
            return x.unsqueeze(0)
        self._check_peers()
        out = torch.empty((self.size, *x.shape), dtype=x.dtype, device=x.device)
        dist.all_gather(list(out.unbind(0)), x.contiguous())
        return out

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate each rank's slice of the last dimension (vocab-parallel logits)."""
        if self.size == 1:
            return x
        self._check_peers()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=-1)


SINGLE = TPGroup()


def rank_group(rank: int, size: int, backend: str, dtype: torch.dtype,
               peer_exited: threading.Event | None = None, large_capacity: int = 0,
               all_reduce: str = "engine") -> TPGroup:
    """This rank's TPGroup, once the process group exists; collective (every rank calls it together).

    all_reduce="engine" (EngineConfig.tp_all_reduce), on GPUs: all-reduces of decode-step size go through
    symmetric memory (OneShotAllReduce: faster decode steps, and the one after each row-parallel projection
    fused with the residual add and the next RMSNorm), and the larger ones of up to `large_capacity`
    elements (a prefill step's rows × hidden size) are carried by the copy engines (CopyEngineSum); where a
    rank cannot map its peers' memory, every rank uses NCCL, with a warning. "nccl": every all-reduce in
    NCCL (gloo on CPU either way).
    """
    one_shot = pushed = None
    if size > 1 and backend == "nccl" and all_reduce == "engine":
        device = torch.device("cuda", rank)
        one_shot = OneShotAllReduce.create(device, dtype, rank, size)
        if one_shot is not None and large_capacity > 0:
            pushed = CopyEngineSum.create(device, dtype, rank, size, large_capacity, COPY_CHUNKS)
    return TPGroup(rank, size, one_shot, peer_exited, pushed=pushed)


def divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(f"{what} ({numerator}) must be divisible by tensor_parallel_size ({denominator})")
    return numerator // denominator
