"""CUDA graphs for decode steps: one graph per padded batch size, replayed over static buffers.

A step's inputs (token ids, positions, cache slots, lengths, block tables, which rows take the previous
step's tokens, the sampling seed) reach the device in one copy from a pinned host buffer. On one GPU
the graph also does what used to be launched one kernel at a time around it: the rows whose token the
previous step sampled take it from the device, and after the layers it runs the LM head, samples
(greedy or Gumbel-max: engine/sampling/sampler.py's graph functions) with each sampled token's logprob. So a
decode step is one copy in, one replay and the copies of the tokens and their logprobs out. Under tensor
parallelism the graphs hold the layers only, as before.

On one GPU, a prefill step of one sequence of up to 2,048 tokens replays a graph too (PrefillGraphs).
"""
from __future__ import annotations

import numpy as np
import torch

from engine.attention import AttentionMetadata
from engine.execution import graph_edges
from engine.sampling.sampler import graph_sampling_available, sample_in_graph, take_pending

GRAPH_SIZES = [1, 2, 4, 8] + list(range(16, 1025, 16))


class StepBuffer:
    """Named arrays in one device buffer, filled by one copy a step from a pinned host buffer. The host
    buffers are a ring, and each waits for its last copy before it is written again, so the host never
    overwrites what a queued copy has still to read."""

    RING = 4

    def __init__(self, fields: list[tuple[str, torch.dtype, int]], device: torch.device):
        self.offsets: dict[str, int] = {}
        size = 0
        for name, dtype, count in fields:
            self.offsets[name] = size
            size += -(-count * dtype.itemsize // 16) * 16  # every array 16-byte aligned
        self.device_bytes = torch.zeros(size, dtype=torch.uint8, device=device)
        self.arrays = {name: self._slice(self.device_bytes, name, dtype, count) for name, dtype, count in fields}
        self.host_bytes = [torch.zeros(size, dtype=torch.uint8).pin_memory() for _ in range(self.RING)]
        self.host_arrays = [{name: self._slice(h, name, dtype, count).numpy() for name, dtype, count in fields}
                            for h in self.host_bytes]
        self.copied = [None] * self.RING
        self.slot = 0
        self.stream = None  # the stream the copies are queued on, looked up once (a lookup is a few µs)

    def _slice(self, buffer: torch.Tensor, name: str, dtype: torch.dtype, count: int) -> torch.Tensor:
        start = self.offsets[name]
        return buffer[start: start + count * dtype.itemsize].view(dtype)

    def host(self) -> dict[str, np.ndarray]:
        """The arrays of the next host buffer, free to write."""
        if self.copied[self.slot] is not None:
            self.copied[self.slot].synchronize()
        return self.host_arrays[self.slot]

    def upload(self, num_bytes: int) -> None:
        """Queue the copy of the first num_bytes of the host buffer just written."""
        self.device_bytes[:num_bytes].copy_(self.host_bytes[self.slot][:num_bytes], non_blocking=True)
        event = self.copied[self.slot] or torch.cuda.Event()
        self.stream = self.stream or torch.cuda.current_stream(self.device_bytes.device)
        event.record(self.stream)
        self.copied[self.slot] = event
        self.slot = (self.slot + 1) % self.RING


@torch.inference_mode()
def capture_largest_first(ctx, sizes: list[int], meta, step, graphs: dict, outputs: dict,
                          edges_moved: dict | None = None, pool=None) -> None:
    """One CUDA graph of step(size) per size into graphs[size] (what it returns into outputs[size]), largest
    first so that the smaller graphs fit in the first one's memory pool. For each size, ctx.meta = meta(size)
    and a warm-up run outside the capture (kernels compile there); then fresh metadata, since what the backend
    derived during the warm-up (a decode order) must be derived again inside the capture, from the buffers
    each replay refills. With edges_moved, the graphs of sizes graph_edges.rewrites have their edges from
    GEMMs (all, or those into kernels other than attention) opened at launch, recorded there per size. pool: an
    earlier set's memory pool to share (graphs never replayed at once)."""
    for size in reversed(sizes):
        ctx.meta = meta(size)
        step(size)
        ctx.meta = meta(size)
        rewrite = graph_edges.rewrites(size) if edges_moved is not None else None
        graph = torch.cuda.CUDAGraph(keep_graph=rewrite is not None)
        with torch.cuda.graph(graph, pool):
            outputs[size] = step(size)
        if rewrite is not None:
            edges_moved[size] = graph_edges.open_at_launch(graph.raw_cuda_graph(), rewrite)
            graph.instantiate()
        pool = pool or graph.pool()
        graphs[size] = graph
        torch.cuda.synchronize()
    ctx.meta = None


class DecodeGraphs:
    def __init__(self, runner):
        cfg = runner.config
        self.runner = runner
        self.sizes = [s for s in GRAPH_SIZES if s < cfg.max_num_seqs] + [cfg.max_num_seqs]
        self.max_bs = max_bs = self.sizes[-1]
        self.max_blocks = cfg.max_blocks_per_seq
        dev = runner.device
        i64, i32 = torch.int64, torch.int32
        # LoRA (engine/lora): a second set of graphs for steps with adapter rows, their kernels reading the rows'
        # tiles (engine/kernels/lora.py) from this buffer; only where the layers run the engine's kernels
        self.lora = runner.lora if runner.lora is not None and cfg.fused_layers else None
        lora_tiles = 0
        lora_fields = []
        if self.lora is not None:
            from engine.kernels.lora import max_tiles

            lora_tiles = max_tiles(max_bs, self.lora.max_loras)
            lora_fields = [("lora_order", i32, max_bs), ("lora_tile_slot", i32, lora_tiles),
                           ("lora_tile_start", i32, lora_tiles), ("lora_tile_end", i32, lora_tiles)]
        # block tables last: a step copies only the rows it has
        self.buffer = StepBuffer([("input_ids", i64, max_bs), ("positions", i64, max_bs),
                                  ("slot_mapping", i64, max_bs), ("pending_src", i64, max_bs), ("seed", i64, 1),
                                  ("seqlens_k", i32, max_bs), *lora_fields,
                                  ("block_tables", i32, max_bs * self.max_blocks)], dev)
        a = self.buffer.arrays
        self.input_ids, self.positions, self.slot_mapping = a["input_ids"], a["positions"], a["slot_mapping"]
        self.pending_src, self.seed, self.seqlens_k = a["pending_src"], a["seed"], a["seqlens_k"]
        self.block_tables = a["block_tables"].view(max_bs, self.max_blocks)
        self.slot_mapping.fill_(-1)
        self.seqlens_k.fill_(1)
        self.cu_seqlens_q = torch.arange(max_bs + 1, dtype=i32, device=dev)
        # sampling in the graph: one rank only (under TP the ranks share the sampling through collectives)
        self.samples = runner.tp.size == 1 and graph_sampling_available()
        # the sampled ids, then their logprobs, in one buffer: a step takes both to the host in one copy
        self.sampled = torch.zeros(max_bs * 12, dtype=torch.uint8, device=dev)
        self.tokens = self.sampled[: 8 * max_bs].view(i64)
        self.token_logprobs = self.sampled[8 * max_bs:].view(torch.float32)
        self.temperatures = torch.zeros(max_bs, dtype=torch.float32, device=dev)  # 0: greedy
        self._temperatures_of = None  # the tensor self.temperatures holds a copy of
        self._tokens_sampled = None   # the view of self.tokens the last sampling replay returned
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.edges_moved: dict[int, dict[str, int]] = {}  # edges opened at launch: per size, per kernel
        self.outputs: dict[int, torch.Tensor] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self._capture_all(cfg.max_model_len)
        self.lora_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.lora_outputs: dict[int, torch.Tensor] = {}
        self.lora_logits: dict[int, torch.Tensor] = {}
        if self.lora is not None:
            a["lora_tile_slot"].fill_(-1)
            self._capture_lora(cfg.max_model_len)

    def _lora_tiles(self, bs: int):
        """The tiles a LoRA graph of size bs reads: as many as bs rows over the slots can need."""
        from engine.kernels.lora import LoRATiles, max_tiles

        a, count = self.buffer.arrays, max_tiles(bs, self.lora.max_loras)
        return LoRATiles(a["lora_order"], a["lora_tile_slot"][:count], a["lora_tile_start"][:count],
                         a["lora_tile_end"][:count])

    def _capture_lora(self, max_model_len: int) -> None:
        """The graphs of decode steps with adapter rows: the layers with their LoRA products (the LoRA
        projections unfused from their norms), the kernels' tiles read from the step buffer."""
        base_logits, self.logits = self.logits, self.lora_logits  # _step keeps each size's logits there

        def step(bs: int) -> torch.Tensor:
            self.lora.use_tiles(self._lora_tiles(bs))
            try:
                return self._step(bs)
            finally:
                self.lora.use_tiles(None)

        try:
            capture_largest_first(self.runner.ctx, self.sizes, lambda bs: self._meta(bs, max_model_len), step,
                                  self.lora_graphs, self.lora_outputs, pool=self.graphs[self.max_bs].pool())
        finally:
            self.logits = base_logits

    def _meta(self, bs: int, max_seqlen_k: int) -> AttentionMetadata:
        return AttentionMetadata(self.slot_mapping[:bs], self.cu_seqlens_q[: bs + 1], self.seqlens_k[:bs],
                                 self.block_tables[:bs], 1, max_seqlen_k, True)

    def _step(self, bs: int) -> torch.Tensor:
        """What a replay of size bs runs; returns the hidden states."""
        model = self.runner.model
        input_ids = self.input_ids[:bs]
        if self.samples:  # rows still waiting for the previous step's token take it from the device
            input_ids = take_pending(input_ids, self.pending_src[:bs], self.tokens)
        hidden = model(input_ids, self.positions[:bs])
        if self.samples:
            self.logits[bs] = logits = model.compute_logits(hidden)
            sample_in_graph(logits, self.temperatures[:bs], self.seed, out=self.tokens[:bs],
                            logprobs_out=self.token_logprobs[:bs])
        return hidden

    def _capture_all(self, max_model_len: int) -> None:
        capture_largest_first(self.runner.ctx, self.sizes, lambda bs: self._meta(bs, max_model_len), self._step,
                              self.graphs, self.outputs, self.edges_moved)

    def fits(self, inputs) -> bool:
        return (len(inputs.input_ids) <= self.max_bs and inputs.block_tables.shape[1] <= self.max_blocks
                and (inputs.lora_slot_ids is None or self.lora is not None))

    def _graph(self, inputs, bs: int) -> tuple[torch.cuda.CUDAGraph, dict, dict]:
        """(The graph of size bs for the step, its hidden states by size, its logits by size)."""
        if inputs.lora_slot_ids is None:
            return self.graphs[bs], self.outputs, self.logits
        return self.lora_graphs[bs], self.lora_outputs, self.lora_logits

    def _upload_lora(self, a: dict, inputs, bs: int) -> None:
        """The step's rows per adapter slot as its LoRA graph's kernels read them (empty tiles: slot -1)."""
        from engine.kernels.lora import make_tiles, max_tiles

        order, slots, starts, ends = make_tiles(inputs.lora_slot_ids)
        count = max_tiles(bs, self.lora.max_loras)
        a["lora_order"][:len(order)] = order
        a["lora_tile_slot"][:count] = -1
        a["lora_tile_slot"][:len(slots)] = slots
        a["lora_tile_start"][:len(starts)] = starts
        a["lora_tile_end"][:len(ends)] = ends

    def _size(self, num_seqs: int) -> int:
        return next(s for s in self.sizes if s >= num_seqs)

    def _upload(self, inputs, bs: int, seed: int, pending: bool) -> None:
        """The step's inputs into the next host buffer, rows past the batch as padding (write nothing,
        read one valid slot), then one copy to the device."""
        n = len(inputs.input_ids)
        a = self.buffer.host()
        a["input_ids"][:n] = inputs.input_ids.numpy()
        a["positions"][:n] = inputs.positions.numpy()
        a["slot_mapping"][:n] = inputs.slot_mapping.numpy()
        a["seqlens_k"][:n] = inputs.seqlens_k.numpy()
        a["input_ids"][n:bs] = a["positions"][n:bs] = 0
        a["slot_mapping"][n:bs] = -1
        a["seqlens_k"][n:bs] = 1
        a["pending_src"][:bs] = -1
        if pending and inputs.pending_rows is not None:
            a["pending_src"][inputs.pending_rows.numpy()] = inputs.pending_src.numpy()
        a["seed"][0] = seed
        if inputs.lora_slot_ids is not None:
            self._upload_lora(a, inputs, bs)
        width = inputs.block_tables.shape[1]
        tables = a["block_tables"].reshape(self.max_bs, self.max_blocks)
        tables[:n, :width] = inputs.block_tables.numpy()
        # padding rows keep the rows of an earlier step, or the zeros they started with: valid blocks
        self.buffer.upload(self.buffer.offsets["block_tables"] + n * self.max_blocks * 4)

    def replay(self, inputs, input_ids: torch.Tensor) -> torch.Tensor:
        """Hidden states of the batch (the smallest captured size >= it); input_ids already on the
        device, pending tokens filled in."""
        n = len(inputs.input_ids)
        bs = self._size(n)
        self._upload(inputs, bs, seed=0, pending=False)
        self.input_ids[:n].copy_(input_ids)
        self._tokens_sampled = None  # the graph samples over self.tokens all the same
        graph, outputs, _ = self._graph(inputs, bs)
        graph.replay()
        return outputs[bs][:n]

    def replay_sampled(self, inputs, temperatures: torch.Tensor | None, seed: int,
                       previous: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One decode step with sampling: (token ids [n], logits [n, vocab]), views of the graph's buffers,
        valid until the next replay; the ids' logprobs are beside them in self.sampled. temperatures: [n] on
        the device (0: greedy), or None for greedy rows whose tokens the caller does not use (it samples from
        the logits itself).
        previous: the previous step's sampled ids, which pending rows index."""
        n = len(inputs.input_ids)
        bs = self._size(n)
        if previous is not self._tokens_sampled and previous.numel():
            self.tokens[: previous.numel()].copy_(previous)
        if temperatures is not self._temperatures_of:
            if temperatures is None:
                self.temperatures.zero_()
            else:
                self.temperatures[:n].copy_(temperatures)
                self.temperatures[n:].zero_()
            self._temperatures_of = temperatures
        self._upload(inputs, bs, seed, pending=True)
        graph, _, logits = self._graph(inputs, bs)
        graph.replay()
        self._tokens_sampled = self.tokens[:n]
        return self._tokens_sampled, logits[bs][:n]


PREFILL_GRAPH_TOKENS = [16, 32, 64, 128, 256, 512, 1024, 2048]


def prefill_graph_sizes(config) -> list[int]:
    """The token counts to capture: those no larger than the step's token budget or the context."""
    limit = min(config.max_num_batched_tokens, config.max_model_len)
    return [s for s in PREFILL_GRAPH_TOKENS if s <= limit]


def prefill_graph_size(num_tokens: int, sizes: list[int]) -> int | None:
    """The smallest captured token count that holds a prefill of num_tokens, or None past the largest."""
    return next((s for s in sizes if s >= num_tokens), None)


def fill_padded_prefill(a: dict[str, np.ndarray], inputs, size: int) -> None:
    """One sequence's prefill inputs as a graph of `size` tokens reads them: rows past its n tokens take
    token 0, position 0 and slot -1 (nothing stored); the query lengths count the n rows only."""
    n = len(inputs.input_ids)
    a["input_ids"][:n] = inputs.input_ids.numpy()
    a["positions"][:n] = inputs.positions.numpy()
    a["slot_mapping"][:n] = inputs.slot_mapping.numpy()
    a["input_ids"][n:size] = a["positions"][n:size] = 0
    a["slot_mapping"][n:size] = -1
    a["cu_seqlens_q"][:] = (0, n)
    a["seqlens_k"][0] = int(inputs.seqlens_k[0])
    width = inputs.block_tables.shape[1]
    a["block_tables"][:width] = inputs.block_tables[0].numpy()


class PrefillGraphs:
    """CUDA graphs for a prefill step of one sequence (a lone prompt, or one chunk of it), one per padded
    token count, replayed over static buffers.

    An eager prefill launches ~12 kernels a layer from Python, ~40 µs of host time each; for a short
    prompt that host time is the whole first token (the device needs ~2 ms of a ~15 ms prefill of 512
    tokens). The graphs hold the layers only: the LM head and the sampler run after them as for any
    prefill. Padding rows (fill_padded_prefill) store nothing, and no row of the real sequence reads
    them: the attention covers the sequence's query rows only, and every other kernel works row by row.
    """

    def __init__(self, runner, sizes: list[int]):
        """sizes: the token counts to capture (prefill_graph_sizes), at least one."""
        cfg = runner.config
        self.runner = runner
        self.sizes = sizes
        self.max_tokens = max_t = sizes[-1]
        self.max_blocks = cfg.max_blocks_per_seq
        self.max_model_len = cfg.max_model_len
        i64, i32 = torch.int64, torch.int32
        self.buffer = StepBuffer([("input_ids", i64, max_t), ("positions", i64, max_t), ("slot_mapping", i64, max_t),
                                  ("cu_seqlens_q", i32, 2), ("seqlens_k", i32, 1),
                                  ("block_tables", i32, self.max_blocks)], runner.device)
        a = self.buffer.arrays
        self.input_ids, self.positions, self.slot_mapping = a["input_ids"], a["positions"], a["slot_mapping"]
        self.cu_seqlens_q, self.seqlens_k = a["cu_seqlens_q"], a["seqlens_k"]
        self.block_tables = a["block_tables"].view(1, self.max_blocks)
        self.slot_mapping.fill_(-1)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.replays = 0
        self._capture_all()

    def _meta(self, num_tokens: int) -> AttentionMetadata:
        return AttentionMetadata(self.slot_mapping[:num_tokens], self.cu_seqlens_q, self.seqlens_k, self.block_tables,
                                 num_tokens, self.max_model_len, False, has_decode_rows=False)

    def _capture_all(self) -> None:
        model = self.runner.model

        def meta(size: int) -> AttentionMetadata:
            """A valid sequence of every row to warm up and capture over; its slots are nowhere (nothing
            is stored)."""
            self.cu_seqlens_q.copy_(torch.tensor([0, size], dtype=torch.int32))
            self.seqlens_k.fill_(size)
            return self._meta(size)

        capture_largest_first(self.runner.ctx, self.sizes, meta,
                              lambda size: model(self.input_ids[:size], self.positions[:size]),
                              self.graphs, self.outputs)

    def fits(self, inputs) -> bool:
        """One sequence's prompt tokens (more than one), no longer than the largest graph."""
        return (len(inputs.seqlens_k) == 1 and 1 < len(inputs.input_ids) <= self.max_tokens
                and inputs.block_tables.shape[1] <= self.max_blocks)

    def replay(self, inputs, input_ids: torch.Tensor) -> torch.Tensor:
        """Hidden states of the step's tokens; input_ids already on the device, pending tokens filled in."""
        n = len(inputs.input_ids)
        size = prefill_graph_size(n, self.sizes)
        fill_padded_prefill(self.buffer.host(), inputs, size)
        self.buffer.upload(self.buffer.offsets["block_tables"] + inputs.block_tables.shape[1] * 4)
        self.input_ids[:n].copy_(input_ids)
        self.graphs[size].replay()
        self.replays += 1
        return self.outputs[size][:n]
