"""Tensor parallelism: rank 0 in the engine's process drives ranks 1..N-1, one spawned process each.

Every rank holds a ModelRunner over its slice of the weights and KV heads. Rank 0 schedules, builds the
step's inputs and samples; each step it sends the inputs to every other rank over that rank's pipe and
queues its own share of the forward pass and the sampling (the ranks meet in torch.distributed
collectives: NCCL on GPUs, gloo on CPU) without waiting for them. A step's handle collects every rank's
acknowledgement before it hands out the tokens; with async scheduling that happens after the next step
was launched, so at most two steps are unacknowledged. A pipe delivers each command whole and in order,
and each rank answers its commands in order, so the n-th "ok" of a rank acknowledges the n-th step.

A rank that dies, raises or stops answering stops the engine: rank 0 raises RankFailedError naming the
rank, and every rank process is ended. NCCL would wait forever on a dead peer, so on GPUs rank 0 never
blocks on its own GPU work before every rank acknowledged the step; it watches the pipes and the
processes instead. On a failure it frees its CUDA graphs, then aborts its communicator, which makes the
kernels waiting on the dead peer return (NCCL finishes an abort only once the graphs that captured the
communicator are gone). The abort runs in a thread of its own and rank 0 waits for it a bounded time, so
the error is raised even where the GPU work cannot be released. A watcher thread covers the case where
rank 0 is blocked on its GPU when a rank dies: if rank 0 has not taken the failure path a moment after
the death, the watcher aborts the communicator itself.
"""
from __future__ import annotations

import gc
import logging
import os
import signal
import sys
import threading
import time
import traceback
import warnings
import weakref
from collections import deque
from dataclasses import dataclass, fields
from datetime import timedelta
from multiprocessing import get_context
from multiprocessing.connection import Connection, wait

import numpy as np
import torch
import torch.distributed as dist

from engine.config import EngineConfig, set_tensor_parallel_gpu_environment
from engine.execution.model_runner import Executed, ModelRunner
from engine.layers.parallel import rank_group
from engine.runner import GrammarMasks, StepInputs
from engine.sampling.sampler import SampledTokens

HOST = "127.0.0.1"
# Backstops only: a dead or failed rank is noticed through its process and pipe within a second.
GROUP_TIMEOUT_S = 300    # rendezvous, and any single collective
STEP_TIMEOUT_S = 300     # one step's acknowledgements
STOP_GRACE_S = 10        # a worker told to exit gets this long before it is killed
FAILURE_GRACE_S = 2      # after rank 0's own collective failed, how long to wait for the peer's news
WATCH_GRACE_S = 2        # a rank died and rank 0 has not noticed in this long: it is blocked on its GPU
ABORT_WAIT_S = 10        # how long rank 0 waits for its communicator's abort before it raises anyway

logger = logging.getLogger(__name__)


class RankFailedError(RuntimeError):
    """A tensor-parallel rank died, raised or stopped answering; the engine has stopped."""


class TPDriver:
    """Rank 0 of a tensor-parallel engine, a Runner (engine/runner.py) as ModelRunner is: execute_model,
    sample_tokens, device, num_kvcache_blocks, uses_mrope; shutdown() ends the other ranks."""

    def __init__(self, config: EngineConfig):
        size = config.tensor_parallel_size
        backend = _backend_for(config)
        if dist.is_initialized():
            raise RuntimeError("torch.distributed is already initialized in this process (is another tensor-parallel "
                               "engine still running?); shut that engine down before starting this one")
        if backend == "nccl":
            set_tensor_parallel_gpu_environment()
        self._workers = workers = _Workers(backend)
        if backend == "gloo":  # the ranks share the cores; idle threads spinning would starve the peer's collectives
            workers.saved_num_threads = torch.get_num_threads()
            torch.set_num_threads(min(workers.saved_num_threads, _cpu_share(size)))
        self._finalizer = weakref.finalize(self, workers.close)
        try:
            workers.store = dist.TCPStore(HOST, 0, size, is_master=True, wait_for_workers=False,
                                          timeout=timedelta(seconds=GROUP_TIMEOUT_S))
            workers.start(_config_kwargs(config), size)
            workers.wait_joined()
            dist.init_process_group(backend, store=workers.store, rank=0, world_size=size,
                                    timeout=timedelta(seconds=GROUP_TIMEOUT_S), **_device_id(backend, 0))
            workers.group = dist.group.WORLD
            tp = workers.tp = rank_group(0, size, backend, config.torch_dtype, peer_exited=workers.rank_died,
                                         large_capacity=_large_all_reduce_capacity(config),
                                         all_reduce=config.tp_all_reduce)
            self.runner = workers.rank0 = ModelRunner(config, tp, capture_graphs=False)
            workers.collect("ready", expect=self.runner.num_kvcache_blocks, timeout=GROUP_TIMEOUT_S)
            workers.send(("capture",))
            self.runner.capture_graphs()
            workers.collect("ok", timeout=GROUP_TIMEOUT_S)
        except BaseException as e:
            workers.fail(e, "while starting")
        self.device = self.runner.device
        self.num_kvcache_blocks = self.runner.num_kvcache_blocks
        self.ctx = self.runner.ctx
        self.sampler = self.runner.sampler
        self.uses_mrope = self.runner.uses_mrope
        self.has_lm_head = self.runner.has_lm_head
        self.lora_modules = self.runner.lora_modules

    @property
    def worker_pids(self) -> list[int]:
        """Process ids of ranks 1..N-1."""
        return [w.process.pid for w in self._workers.workers]

    def execute_model(self, inputs: StepInputs) -> Executed:
        """Send the step to every rank and queue rank 0's forward pass (and a sharded sampling) without
        waiting for the other ranks."""
        workers = self._workers
        workers.check_running()
        try:
            st = self.sampler.tensors(inputs)
            # the other ranks join the sampling's collectives only when rank 0 samples (plan is not None)
            plan = self.sampler.plan(st, self.runner.tp.size)
            workers.send(("execute", _to_wire(inputs), plan))
            return self.runner.execute(inputs, st, plan)
        except BaseException as e:
            workers.fail(e, "during a step")

    def sample_tokens(self, handle: Executed, masks: GrammarMasks | None) -> "TPStep":
        """Queue rank 0's sampling of the step (the other ranks took their part in execute_model); the
        returned handle's result() collects every rank's acknowledgement, then the tokens."""
        workers = self._workers
        try:
            tokens = self.runner.sample_tokens(handle, masks)
        except BaseException as e:
            workers.fail(e, "during a step")
        return TPStep(workers, workers.num_sent, tokens)

    def trace_ranks(self, path: str | None) -> None:
        """Measurements: ranks 1..N-1 start a torch.profiler trace of their GPU (path: a file name with
        {rank} in it), or, with None, stop it and write it there. Not acknowledged; steps stay in order."""
        self._workers.check_running()
        self._workers.send(("trace", path))

    def shutdown(self) -> None:
        """Tell the other ranks to exit, end any that do not, release the process group and rank 0's device
        memory (to this process's allocator: see ModelRunner.shutdown). Idempotent."""
        self._finalizer()
        self.runner.shutdown(return_to_driver=False)


class TPStep:
    """A launched tensor-parallel step: result() waits for every rank's acknowledgement of it (and of any
    earlier step), then for rank 0's tokens."""

    def __init__(self, workers: "_Workers", step: int, tokens: SampledTokens):
        self._workers, self._step, self._tokens = workers, step, tokens

    def result(self):
        """(token ids, logprobs or None), as ModelRunner's SampledTokens.result()."""
        workers = self._workers
        workers.check_running()
        try:
            workers.collect_acks(self._step)
        except BaseException as e:
            workers.fail(e, "during a step")
        # every rank finished its part of the step, so rank 0's own work of it waits on no peer: blocking is safe
        return self._tokens.result()

    def prompt_result(self):
        """Rank 0's prompt logprobs of the step, as ModelRunner's; after result(), which waits for the ranks."""
        return self._tokens.prompt_result()


@dataclass
class _Worker:
    rank: int
    process: object  # multiprocessing's SpawnProcess
    conn: Connection
    error: str | None = None  # traceback text the rank sent before it exited
    started: bool = False     # it reported its runner ready

    def describe(self) -> str:
        who = f"tensor-parallel rank {self.rank} (pid {self.process.pid})"
        if self.error:
            return f"{who} raised an error"
        self.process.join(timeout=1)
        code = self.process.exitcode
        if code is None:
            return f"{who} stopped answering"
        if code < 0:
            return f"{who} was killed by signal {_signal_name(-code)}"
        if not self.started:  # it died before it could send its traceback
            return (f"{who} exited with code {code} while starting (its traceback is on stderr). Ranks are spawned "
                    f"processes that import the main module: start the engine under `if __name__ == '__main__':`")
        return f"{who} exited with code {code}"


class _Workers:
    """Ranks 1..N-1 as seen from rank 0: their processes and pipes, and the process group's lifetime.
    Holds no reference to the TPDriver, so the driver's finalizer can close it."""

    def __init__(self, backend: str):
        self.backend = backend
        self.workers: list[_Worker] = []
        self.store = None
        self.group = None
        self.tp = None  # rank 0's TPGroup
        self.rank0: ModelRunner | None = None
        self.saved_num_threads: int | None = None  # this process's CPU threads before the ranks shared the cores
        self.failure: str | None = None
        self.closed = False
        self.num_sent = 0   # steps sent to the ranks
        self.num_acked = 0  # steps every rank acknowledged
        self.rank_died = threading.Event()  # the watcher saw a rank's process exit
        self._stop_watch = threading.Event()
        self._watch: threading.Thread | None = None
        self._abort_lock = threading.Lock()
        self._abort_thread: threading.Thread | None = None

    # ---- start ------------------------------------------------------------------------------------

    def start(self, config_kwargs: dict, size: int) -> None:
        ctx = get_context("spawn")
        for rank in range(1, size):
            parent_end, child_end = ctx.Pipe()
            process = ctx.Process(target=_worker_main, name=f"redline-tp-rank{rank}", daemon=True,
                                  args=(rank, size, self.backend, self.store.port, config_kwargs, child_end))
            process.start()
            child_end.close()
            self.workers.append(_Worker(rank, process, parent_end))
        if self.backend == "nccl":
            self._watch = threading.Thread(target=self._watch_ranks, name="redline-tp-watch", daemon=True)
            self._watch.start()

    def wait_joined(self) -> None:
        """Wait until every rank reached the rendezvous, watching for ranks that die on the way."""
        keys = [f"joined/{w.rank}" for w in self.workers]
        deadline = time.monotonic() + GROUP_TIMEOUT_S
        while not self.store.check(keys):
            self._raise_if_any_died(timeout=0.05)
            if time.monotonic() > deadline:
                self.stop(f"tensor-parallel ranks did not start within {GROUP_TIMEOUT_S} s")

    def _watch_ranks(self) -> None:
        """On GPUs, for the engine's whole life: when a rank's process exits and rank 0 has not taken the
        failure path WATCH_GRACE_S later, rank 0 is blocked on GPU work that waits for the dead peer (or on
        the group's rendezvous): abort the communicator, which makes that work return."""
        sentinels = [w.process.sentinel for w in self.workers]
        while not wait(sentinels, timeout=0.2):
            if self._stop_watch.is_set():
                return
        self.rank_died.set()  # rank 0 queues no collective from now on (TPGroup checks), so none waits on the abort
        self._stop_peer_waits()
        if self._stop_watch.wait(WATCH_GRACE_S):  # rank 0 noticed and is closing the engine
            return
        while self.group is None:  # died before the group was made: abort it once it is
            if self._stop_watch.wait(0.05):
                return
        logger.warning("a tensor-parallel rank exited and rank 0 has not noticed for %s s: aborting the "
                       "communicator to release rank 0's GPU work", WATCH_GRACE_S)
        self._start_abort()

    def _stop_peer_waits(self) -> None:
        """Release rank 0's symmetric-memory all-reduces waiting on a dead peer (NCCL's abort cannot)."""
        if self.tp is not None:
            try:
                self.tp.stop_peer_waits()
            except Exception:  # noqa: BLE001 (best effort on the way down)
                logger.exception("could not release rank 0's all-reduce kernels")

    def _start_abort(self) -> threading.Thread:
        """Abort the NCCL communicator in a thread of its own (once): it returns only after rank 0's CUDA
        graphs are gone and its kernels saw the abort, and rank 0 must not wait on that unboundedly."""
        with self._abort_lock:
            if self._abort_thread is None:
                self._abort_thread = threading.Thread(target=_abort_process_group, name="redline-tp-abort",
                                                      daemon=True)
                self._abort_thread.start()
            return self._abort_thread

    # ---- the command channel ----------------------------------------------------------------------

    def check_running(self) -> None:
        if self.failure is not None:
            raise RankFailedError(f"the tensor-parallel engine stopped earlier: {self.failure}")
        if self.closed:
            raise RuntimeError("the tensor-parallel engine was shut down; create a new one")
        if self.rank_died.is_set():  # queue no more collectives: they would wait for the dead rank
            self._raise_if_any_died(timeout=1)

    def send(self, message: tuple) -> None:
        if message[0] == "execute":
            self.num_sent += 1
        for w in self.workers:
            try:
                w.conn.send(message)
            except OSError:  # the rank's end of the pipe is gone
                self._read_news(w)
                self.stop(w.describe(), w)

    def collect_acks(self, step: int) -> None:
        """Wait until every rank acknowledged every step up to `step` (they answer in order)."""
        while self.num_acked < step:
            self.collect("ok")
            self.num_acked += 1

    def collect(self, kind: str, expect=None, timeout: float = STEP_TIMEOUT_S) -> None:
        """Wait for every rank's answer to the last command; any other news stops the engine."""
        pending = {w.conn: w for w in self.workers}
        by_sentinel = {w.process.sentinel: w for w in self.workers}
        deadline = time.monotonic() + timeout
        while pending:
            watched = [*pending, *(w.process.sentinel for w in pending.values())]
            ready = wait(watched, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                w = next(iter(pending.values()))
                self.stop(f"tensor-parallel rank {w.rank} (pid {w.process.pid}) did not answer within {timeout:.0f} s")
            for obj in ready:
                w = pending.get(obj) or by_sentinel.get(obj)
                if w is None or w.conn not in pending:
                    continue
                reply = self._read_news(w)
                if reply is None and obj is not w.conn:
                    reply = ("dead",)
                if reply is None:
                    continue
                if reply[0] != kind:
                    self.stop(w.describe(), w)
                if expect is not None and reply[1] != expect:
                    self.stop(f"tensor-parallel rank {w.rank} sized its KV cache to {reply[1]} blocks, "
                              f"rank 0 to {expect}")
                w.started = True
                del pending[w.conn]

    def _read_news(self, w: _Worker) -> tuple | None:
        """The rank's next message if one is waiting; ("dead",) when its pipe is closed."""
        try:
            if not w.conn.poll():
                return None
            reply = w.conn.recv()
        except (EOFError, OSError):
            return ("dead",)
        if reply[0] == "error":
            w.error = reply[1]
        return reply

    def _raise_if_any_died(self, timeout: float) -> None:
        sentinels = {w.process.sentinel: w for w in self.workers}
        for s in wait(list(sentinels), timeout=timeout):
            w = sentinels[s]
            self._read_news(w)
            self.stop(w.describe(), w)

    # ---- failure and shutdown ---------------------------------------------------------------------

    def stop(self, message: str, worker: _Worker | None = None, cause: BaseException | None = None):
        """End every rank and raise RankFailedError: `message`, then the failed rank's traceback if it sent one."""
        self.failure = message
        text = f"{message}; the engine has stopped, create a new one to go on"
        if worker is not None and worker.error:
            text += f"\n--- rank {worker.rank} traceback ---\n{worker.error.rstrip()}"
        self.close(failed=True)
        raise RankFailedError(text) from cause

    def fail(self, exc: BaseException, when: str):
        """Rank 0 raised `exc`: if it came from a collective (a RuntimeError) and a rank failed, blame that
        rank; else re-raise `exc` (a ValueError, say, is rank 0's own and clearest). Either way the ranks may
        now disagree on how far the step went, so the engine stops."""
        if isinstance(exc, RankFailedError):
            raise exc
        if self.backend == "nccl":  # a half-built runner in the traceback may hold graphs that pin the communicator
            traceback.clear_frames(exc.__traceback__)
        culprit = self._failed_worker(FAILURE_GRACE_S) if isinstance(exc, RuntimeError) else None
        if culprit is not None:
            self.stop(f"{culprit.describe()} {when}", culprit, cause=exc)
        self.failure = f"rank 0 raised {type(exc).__name__} {when}: {exc}"
        self.close(failed=True)
        raise exc

    def _failed_worker(self, grace: float) -> _Worker | None:
        deadline = time.monotonic() + grace
        while True:
            for w in self.workers:
                while (news := self._read_news(w)) is not None and news[0] == "ok":
                    pass  # the rank finished its part of the step
                if w.error is not None or news == ("dead",) or not w.process.is_alive():
                    return w
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            wait([*(w.conn for w in self.workers), *(w.process.sentinel for w in self.workers)], timeout=left)

    def close(self, failed: bool = False) -> None:
        """Stop the watcher, tell live ranks to exit, release the process group, end stragglers."""
        if self.closed:
            return
        self.closed = True
        self._stop_watch.set()
        if failed:
            logger.warning("tensor-parallel engine stopping: %s", self.failure)
            self._stop_peer_waits()
        else:
            for w in self.workers:
                try:
                    w.conn.send(("shutdown",))
                except OSError:
                    pass
        self._release_group(self._free_graphs())
        if self._watch is not None:
            self._watch.join()
            self._watch = None
        deadline = time.monotonic() + (1 if failed else STOP_GRACE_S)
        for w in self.workers:
            w.process.join(timeout=max(0.0, deadline - time.monotonic()))
        for w in self.workers:
            for end in (w.process.terminate, w.process.kill):
                if w.process.is_alive():
                    end()
                    w.process.join(timeout=2)
            w.conn.close()
        self.store = None
        if self.saved_num_threads is not None:
            torch.set_num_threads(self.saved_num_threads)

    def _free_graphs(self) -> bool:
        """Free rank 0's CUDA graphs: NCCL's abort and destroy wait until every graph that captured the
        communicator is gone. False if one is still referenced elsewhere."""
        decode_graphs = self.rank0.graphs if self.rank0 is not None else None
        if decode_graphs is None:
            return True
        refs = [weakref.ref(g) for g in getattr(decode_graphs, "graphs", {}).values()]
        self.rank0.graphs = decode_graphs = None
        gc.collect()
        return all(ref() is None for ref in refs)

    def _release_group(self, graphs_freed: bool) -> None:
        if self.group is None or not dist.is_initialized() or dist.group.WORLD is not self.group:
            return
        if self.backend == "nccl" and not graphs_freed:  # tearing it down would wait forever
            warnings.warn("a CUDA graph of rank 0 is still referenced, so its NCCL communicator was left in place; "
                          "this process cannot start another tensor-parallel engine", RuntimeWarning, stacklevel=2)
            return
        if self.backend == "nccl":  # abort never waits on peers, which may be dead or gone
            aborting = self._start_abort()
            aborting.join(ABORT_WAIT_S)
            if aborting.is_alive():
                warnings.warn(f"rank 0's NCCL communicator did not finish aborting within {ABORT_WAIT_S} s (its GPU "
                              "work still waits for the failed rank); this process cannot start another "
                              "tensor-parallel engine", RuntimeWarning, stacklevel=2)
                return
            self.group = None
            return
        self.group = None
        try:
            dist.destroy_process_group()
        except Exception:
            pass


def _abort_process_group() -> None:
    try:
        dist.distributed_c10d._abort_process_group()
    except Exception:  # noqa: BLE001 (a half-torn group: make sure this process holds none)
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass


# ---- the other ranks ------------------------------------------------------------------------------

def _worker_main(rank: int, size: int, backend: str, port: int, config_kwargs: dict, conn: Connection) -> None:
    """Entry point of rank `rank` (a spawned process): build the runner, then run rank 0's commands."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is rank 0's to handle; it ends this process
    _exit_with_parent()
    code = 1
    try:
        runner = _start_rank(rank, size, backend, port, config_kwargs)
        conn.send(("ready", runner.num_kvcache_blocks))
        _serve(runner, conn)
        code = 0
    except BaseException:
        try:
            conn.send(("error", traceback.format_exc()))
        except OSError:
            pass
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # no teardown: the group needs none from a process that ends, and NCCL's could wait on graphs


def _start_rank(rank: int, size: int, backend: str, port: int, config_kwargs: dict) -> ModelRunner:
    config = EngineConfig(**config_kwargs)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(_cpu_share(size))
    store = dist.TCPStore(HOST, port, size, is_master=False, timeout=timedelta(seconds=GROUP_TIMEOUT_S))
    store.set(f"joined/{rank}", "1")
    dist.init_process_group(backend, store=store, rank=rank, world_size=size,
                            timeout=timedelta(seconds=GROUP_TIMEOUT_S), **_device_id(backend, rank))
    return ModelRunner(config, rank_group(rank, size, backend, config.torch_dtype,
                                          large_capacity=_large_all_reduce_capacity(config),
                                          all_reduce=config.tp_all_reduce),
                       capture_graphs=False)


def _large_all_reduce_capacity(config: EngineConfig) -> int:
    """Elements of the largest row-parallel output a step sums: a full prefill step's rows × hidden."""
    return config.max_num_batched_tokens * config.text_config.hidden_size


def _serve(runner: ModelRunner, conn: Connection) -> None:
    """Run each step rank 0 sends and acknowledge it, in order, once this rank's device finished it;
    return on shutdown. While a step runs on the GPU the next command is taken as soon as it arrives, so
    the device never idles while this process wakes, answers and reads."""
    running: deque = deque()  # queued steps not yet acknowledged: a CUDA event each, or _DONE on CPU
    tracing = None  # (profiler, file) while a trace asked for by TPDriver.trace_ranks runs
    while True:
        while running:
            if running[0].query():
                running.popleft()
                conn.send(("ok",))
            elif conn.poll(0.0002):
                break
        message = conn.recv()
        if message[0] == "shutdown":
            return
        if message[0] == "capture":
            runner.capture_graphs()
            if runner.device.type == "cuda":
                torch.cuda.synchronize(runner.device)
            conn.send(("ok",))
            continue
        if message[0] == "trace":
            tracing = _trace(runner, tracing, message[1])
            continue
        _, wire, sampling = message
        inputs = _from_wire(wire)
        hidden = runner.forward(inputs)
        runner.score_prompt(hidden, inputs)  # its part of the prompt rows' logits gathers, as rank 0's execute
        if sampling:
            runner.join_sampling(hidden, inputs, sampling)
        if runner.device.type == "cuda":
            done = torch.cuda.Event()
            done.record()
            running.append(done)
        else:  # the forward pass ran on the host: it is done
            running.append(_DONE)


def _trace(runner: ModelRunner, tracing, path: str | None):
    """Start a trace of this rank's device into path, or stop the running one and write it."""
    if path is not None:
        activity = torch.profiler.ProfilerActivity.CUDA if runner.device.type == "cuda" else \
            torch.profiler.ProfilerActivity.CPU
        profiler = torch.profiler.profile(activities=[activity])
        profiler.__enter__()
        return profiler, path.format(rank=runner.tp.rank)
    if tracing is not None:
        if runner.device.type == "cuda":
            torch.cuda.synchronize(runner.device)
        tracing[0].__exit__(None, None, None)
        tracing[0].export_chrome_trace(tracing[1])
    return None


class _Done:
    @staticmethod
    def query() -> bool:
        return True


_DONE = _Done()


def _exit_with_parent() -> None:
    """End this rank when rank 0's process is gone, even while it waits on a collective."""
    from multiprocessing import parent_process

    parent = parent_process()

    def watch():
        wait([parent.sentinel])
        os._exit(1)

    threading.Thread(target=watch, name="redline-tp-parent", daemon=True).start()


# ---- helpers --------------------------------------------------------------------------------------

def _backend_for(config: EngineConfig) -> str:
    size = config.tensor_parallel_size
    device = torch.device(config.device)
    if device.type == "cuda":
        if device.index is not None:
            raise ValueError(f"device={config.device!r} names one GPU, but tensor_parallel_size={size} puts rank r "
                             f"on cuda:r; pass device='cuda' (choose GPUs with CUDA_VISIBLE_DEVICES)")
        if torch.cuda.device_count() < size:
            raise ValueError(f"tensor_parallel_size={size} needs {size} GPUs; {torch.cuda.device_count()} are visible")
        return "nccl"
    if device.type == "cpu":
        return "gloo"
    raise ValueError(f"tensor parallelism runs on CUDA GPUs or the CPU, not on {device.type!r}")


def _cpu_share(size: int) -> int:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // size)


def _device_id(backend: str, rank: int) -> dict:
    # binding the communicator to its GPU creates it now, before the first collective or graph capture
    return {"device_id": torch.device("cuda", rank)} if backend == "nccl" else {}


def _config_kwargs(config: EngineConfig) -> dict:
    """The engine's settings as constructor arguments, already resolved (the ranks never download)."""
    kwargs = {f.name: getattr(config, f.name) for f in fields(config) if f.init}
    kwargs["model"] = config.model_dir
    return kwargs


# what only rank 0 reads: the sampling (the other ranks get the plan), the sampled sequences' ends, the pooled
# rows, the scored prompt tokens
_RANK0_ONLY = {"sampling", "suppressed", "finished_seq_ids", "pooled_rows", "pooled_segments", "num_pooled",
               "prompt_next_ids", "num_prompt_top"}


def _to_wire(inputs: StepInputs) -> dict:
    # numpy arrays pickle as plain bytes; CPU tensors would go through torch's shared-memory reducer
    wire = {}
    for f in fields(StepInputs):
        if f.name not in _RANK0_ONLY:
            value = getattr(inputs, f.name)
            wire[f.name] = value.numpy() if isinstance(value, torch.Tensor) else value
    return wire


def _from_wire(wire: dict) -> StepInputs:
    return StepInputs(**{k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v for k, v in wire.items()})


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return str(number)
