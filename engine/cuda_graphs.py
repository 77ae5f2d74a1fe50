"""CUDA graphs for decode steps: one graph per padded batch size, replayed over static buffers."""
from __future__ import annotations

import torch

from engine.attention import AttentionMetadata

GRAPH_SIZES = [1, 2, 4, 8] + list(range(16, 1025, 16))


class DecodeGraphs:
    def __init__(self, runner):
        cfg = runner.config
        self.runner = runner
        self.sizes = [s for s in GRAPH_SIZES if s < cfg.max_num_seqs] + [cfg.max_num_seqs]
        self.max_bs = self.sizes[-1]
        self.max_blocks = cfg.max_blocks_per_seq
        dev = runner.device
        self.input_ids = torch.zeros(self.max_bs, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(self.max_bs, dtype=torch.int64, device=dev)
        self.slot_mapping = torch.full((self.max_bs,), -1, dtype=torch.int64, device=dev)
        self.seqlens_k = torch.ones(self.max_bs, dtype=torch.int32, device=dev)
        self.block_tables = torch.zeros(self.max_bs, self.max_blocks, dtype=torch.int32, device=dev)
        self.cu_seqlens_q = torch.arange(self.max_bs + 1, dtype=torch.int32, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self._capture_all(cfg.max_model_len)

    def _meta(self, bs: int, max_seqlen_k: int) -> AttentionMetadata:
        return AttentionMetadata(self.slot_mapping[:bs], self.cu_seqlens_q[: bs + 1], self.seqlens_k[:bs],
                                 self.block_tables[:bs], 1, max_seqlen_k, True)

    @torch.inference_mode()
    def _capture_all(self, max_model_len: int) -> None:
        model, ctx = self.runner.model, self.runner.ctx
        pool = None
        for bs in reversed(self.sizes):  # largest first, so smaller graphs fit in its memory pool
            ctx.meta = self._meta(bs, max_model_len)
            model(self.input_ids[:bs], self.positions[:bs])  # warm-up: compile kernels outside capture
            # fresh metadata: what the backend derived during the warm-up (a decode order) must be
            # derived again inside the capture, from the buffers each replay refills
            ctx.meta = self._meta(bs, max_model_len)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool):
                self.outputs[bs] = model(self.input_ids[:bs], self.positions[:bs])
            pool = pool or graph.pool()
            self.graphs[bs] = graph
            torch.cuda.synchronize()
        ctx.meta = None

    def fits(self, inputs) -> bool:
        return len(inputs.input_ids) <= self.max_bs and inputs.block_tables.shape[1] <= self.max_blocks

    def replay(self, inputs, input_ids: torch.Tensor, to_device) -> torch.Tensor:
        """Run the graph of the smallest captured size >= the batch; input_ids already on the device."""
        n = len(inputs.input_ids)
        bs = next(s for s in self.sizes if s >= n)
        width = inputs.block_tables.shape[1]
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(to_device(inputs.positions))
        self.slot_mapping[:n].copy_(to_device(inputs.slot_mapping))
        self.seqlens_k[:n].copy_(to_device(inputs.seqlens_k))
        self.block_tables[:n, :width].copy_(to_device(inputs.block_tables))
        if bs > n:  # padding rows: write nothing, read one valid slot
            self.slot_mapping[n:bs] = -1
            self.seqlens_k[n:bs] = 1
            self.block_tables[n:bs] = 0
        self.graphs[bs].replay()
        return self.outputs[bs][:n]
