"""Runs a step (engine/runner.py's StepInputs) on one device (one tensor-parallel rank): the forward pass,
the vision tower's images, the sampling. Implements the Runner protocol; reads no Sequence."""
from __future__ import annotations

import gc
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist

from engine.attention import AttentionMetadata, ForwardContext, get_backend, has_decode_rows
from engine.config import EngineConfig
from engine.inputs.loader import load_weights
from engine.layers.attention import Attention
from engine.layers.fusion import PlainTorch
from engine.layers.parallel import TPGroup
from engine.lora.layers import LoRAPool
from engine.models import model_class
from engine.runner import GrammarMasks, ImageSlice, StepInputs
from engine.sampling.sampler import PromptScores, SampledTokens, Sampler, SamplingTensors, StepSampling, score_prompt

CPU_KV_CACHE_BYTES = 2 << 30
# prompt rows whose logits are made at once: 256 float32 rows of a 152k vocabulary are 156 MB, what a decode step
# of 256 rows with logprobs makes too (the KV cache's sizing leaves no room measured for more)
PROMPT_SCORE_ROWS = 256


@contextmanager
def default_float_dtype(dtype: torch.dtype):
    """torch's default floating dtype set to dtype inside (process-wide, as torch keeps it: for the model's
    construction only, which computes its float32 tables with explicit dtypes)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


class ModelRunner:
    def __init__(self, config: EngineConfig, tp: TPGroup = TPGroup(), capture_graphs: bool = True):
        self.config = config
        self.tp = tp
        self.device = torch.device(config.device)
        if self.device.type == "cpu" and config.cpu_threads is not None:
            torch.set_num_threads(config.cpu_threads)  # process-wide, as torch's thread count is
        if self.device.type == "cuda":
            if self.device.index is None:
                self.device = torch.device("cuda", tp.rank)
            torch.cuda.set_device(self.device)
            # An engine dropped without shutdown() leaves its KV cache in the caching allocator once collected.
            # Hand it to the driver before this engine's weights are allocated: a tensor carved out of that
            # segment would pin all of it, and the KV sizing below would see the GPU as nearly full.
            gc.collect()
            torch.cuda.empty_cache()
        # entered wherever the model runs: its kernels and compiled chains, or plain PyTorch (fused_layers=False)
        self.layer_mode = nullcontext() if config.fused_layers else PlainTorch()
        self.dtype = config.torch_dtype
        self.kv_dtype = config.kv_torch_dtype
        self.block_size = config.kvcache_block_size
        sinks = getattr(model_class(config.hf_config.architectures), "attention_sinks", False)
        self.ctx = ForwardContext(get_backend(config.attention_backend, self.device, self.kv_dtype, sinks))
        self.graphs = None  # decode CUDA graphs, captured once the KV cache exists
        self.prefill_graphs = None  # one sequence's prefill steps, on one GPU
        hf = config.hf_config
        # images' vision-tower outputs by ImageSlice.key, from the first step that needs them to their last token
        self.image_embeds: dict[tuple[str, int], torch.Tensor] = {}
        # parameters made in the model's dtype: made in float32 and cast, a 30B model would need 120 GB on the way
        with torch.device(self.device), default_float_dtype(self.dtype):
            self.model = model_class(hf.architectures)(hf, tp, self.ctx).to(self.dtype)
        self.model.eval()
        self.has_lm_head = load_weights(self.model, config.model_dir, config.load_format, config.seed,
                                        config.quantization)
        # M-RoPE (engine/inputs/multimodal.py): positions past a prompt with images are offset by its delta
        self.uses_mrope = getattr(self.model, "uses_mrope", False)
        self.attn_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        # LoRA adapters' device slots, allocated before the KV cache takes what is left
        self.lora = (LoRAPool(self.model, config.max_loras, config.max_lora_rank, self.dtype, self.device, tp.rank)
                     if config.enable_lora else None)
        self.lora_modules = frozenset(self.lora.layers) if self.lora is not None else frozenset()
        self.num_kvcache_blocks = self._allocate_kv_cache()
        self.sampler = Sampler(self.device, config.seed, config.text_config.vocab_size)
        if capture_graphs:
            self.capture_graphs()

    def capture_graphs(self) -> None:
        """Decode CUDA graphs, where the device and backend allow (tensor-parallel ranks call this together),
        and on one GPU the graphs of one sequence's prefill steps."""
        if self.device.type == "cuda" and not self.config.enforce_eager and getattr(self.ctx.backend, "supports_cuda_graphs", False):
            from engine.execution.cuda_graphs import DecodeGraphs, PrefillGraphs, prefill_graph_sizes
            with self.layer_mode:
                self.graphs = DecodeGraphs(self)
                sizes = prefill_graph_sizes(self.config)
                if self.tp.size == 1 and sizes:
                    self.prefill_graphs = PrefillGraphs(self, sizes)

    def shutdown(self, return_to_driver: bool = True) -> None:
        """Give the device memory back now: the CUDA graphs, the KV cache and the weights are dropped and
        collected at once (they sit in reference cycles, which would otherwise wait for the garbage
        collector) and are free for the next engine in this process. return_to_driver: also wait for the
        device and hand the allocator's cached blocks back to the driver (for other processes); a
        tensor-parallel rank 0 does not, since work of a failed step may wait forever on a dead peer.
        Idempotent; no step after it."""
        if self.model is None:
            return
        release = return_to_driver and self.device.type == "cuda"
        if release:
            torch.cuda.synchronize(self.device)
        self.graphs = self.prefill_graphs = None
        for layer in self.attn_layers:
            layer.k_cache = layer.v_cache = torch.tensor([])
        self.attn_layers = []
        self.kv_cache = self.model = self.lora = None  # the LoRA slots too
        self.image_embeds = {}
        self.sampler.release()
        gc.collect()  # the modules are in cycles (each parameter's weight_loader is bound to its module)
        if release:
            torch.cuda.empty_cache()

    # ---- KV cache ---------------------------------------------------------------------------------

    def _kv_bytes_per_block(self) -> int:
        a = self.attn_layers[0]
        return 2 * len(self.attn_layers) * self.block_size * a.num_kv_heads * a.head_dim * self.kv_dtype.itemsize

    def _allocate_kv_cache(self) -> int:
        cfg = self.config
        num_blocks = cfg.num_kvcache_blocks or self._fitting_num_blocks()
        if self.tp.size > 1:  # one block table serves every rank: all hold as many blocks as the tightest one
            count = torch.tensor([num_blocks], device=self.device)
            dist.all_reduce(count, op=dist.ReduceOp.MIN)
            num_blocks = int(count.item())
        if num_blocks < cfg.max_blocks_per_seq:
            raise ValueError(
                f"the KV cache holds {num_blocks} blocks of {self.block_size} tokens, fewer than one sequence of "
                f"max_model_len={cfg.max_model_len} needs ({cfg.max_blocks_per_seq}); lower max_model_len or "
                f"raise num_kvcache_blocks / gpu_memory_utilization")
        a = self.attn_layers[0]
        self.kv_cache = torch.empty(2, len(self.attn_layers), num_blocks, self.block_size, a.num_kv_heads,
                                    a.head_dim, dtype=self.kv_dtype, device=self.device)
        for i, layer in enumerate(self.attn_layers):
            layer.k_cache, layer.v_cache = self.kv_cache[0, i], self.kv_cache[1, i]
        return num_blocks

    def _fitting_num_blocks(self) -> int:
        cfg = self.config
        per_block = self._kv_bytes_per_block()
        if self.device.type != "cuda":
            wanted = -(-cfg.max_num_seqs * cfg.max_model_len // self.block_size)
            return max(min(wanted, CPU_KV_CACHE_BYTES // per_block), cfg.max_blocks_per_seq)
        activation_bytes = self._measure_activation_peak()
        free, total = torch.cuda.mem_get_info(self.device)
        used = total - free
        budget = total * cfg.gpu_memory_utilization - used - activation_bytes
        return max(int(budget // per_block), 0)

    @torch.inference_mode()
    def _measure_activation_peak(self) -> int:
        """Peak memory of one forward over max_num_batched_tokens, beyond weights and a scratch cache."""
        cfg = self.config
        num_tokens = min(cfg.max_num_batched_tokens, cfg.max_num_seqs * cfg.max_model_len)
        num_seqs = max(1, min(cfg.max_num_seqs, num_tokens // cfg.max_model_len or 1))
        seq_len = num_tokens // num_seqs
        blocks_per_seq = -(-seq_len // self.block_size)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        before = torch.cuda.memory_allocated(self.device)
        a = self.attn_layers[0]
        scratch = torch.empty(2, len(self.attn_layers), num_seqs * blocks_per_seq, self.block_size,
                              a.num_kv_heads, a.head_dim, dtype=self.kv_dtype, device=self.device)
        for i, layer in enumerate(self.attn_layers):
            layer.k_cache, layer.v_cache = scratch[0, i], scratch[1, i]
        torch.cuda.reset_peak_memory_stats(self.device)
        vocab = self.config.text_config.vocab_size
        tokens = [[i % vocab for i in range(seq_len)] for _ in range(num_seqs)]
        inputs = prefill_inputs(tokens, self.block_size, blocks_per_seq)
        hidden = self.forward(inputs)
        with self.layer_mode:
            self.model.compute_logits(hidden[inputs.logits_indices.to(self.device)])
            if hasattr(self.model, "encode_images"):  # a step's images: as many image tokens as the step's budget
                pixels, grids = self.model.dummy_images(cfg.max_num_batched_tokens)
                self.model.encode_images(pixels.to(self.device), grids)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated(self.device) - before - scratch.numel() * scratch.element_size()
        del scratch, hidden
        for layer in self.attn_layers:
            layer.k_cache = layer.v_cache = torch.tensor([])
        torch.cuda.empty_cache()
        return peak

    # ---- one step ---------------------------------------------------------------------------------

    def _image_embeds(self, inputs: StepInputs) -> torch.Tensor | None:
        """The embeddings of the step's image tokens, in input row order. The vision tower runs once on
        each image the runner holds none for; an image's embeddings stay until the step that passes its
        last token, or its request ends."""
        todo = {s.key: s for s in inputs.images if s.key not in self.image_embeds}
        if todo:
            self._encode_images(list(todo.values()))
        embeds = torch.cat([self.image_embeds[s.key][s.offset:s.offset + s.length] for s in inputs.images])
        for s in inputs.images:
            if s.is_last:
                self.image_embeds.pop(s.key, None)
        return embeds

    def _forget_images(self, request_ids: list[str]) -> None:
        """These requests ended: drop their images' embeddings (those whose last token never ran)."""
        ended = set(request_ids)
        for key in [k for k in self.image_embeds if k[0] in ended]:
            del self.image_embeds[key]

    @torch.inference_mode()
    def _encode_images(self, images: list[ImageSlice]) -> None:
        """Run the vision tower once over these images, keeping each one's embeddings by its key."""
        pixels = torch.cat([torch.from_numpy(s.pixel_values) for s in images])
        with self.layer_mode:
            embeds = self.model.encode_images(self._to_device(pixels), [s.grid for s in images])
        for s, e in zip(images, embeds.split([s.num_tokens for s in images])):
            self.image_embeds[s.key] = e

    @torch.inference_mode()
    def forward(self, inputs: StepInputs) -> torch.Tensor:
        """Hidden states of every scheduled token."""
        self.copy_blocks(inputs)
        if inputs.finished_request_ids:
            self._forget_images(inputs.finished_request_ids)
        image_embeds = self._image_embeds(inputs) if inputs.images else None
        to = self._to_device
        input_ids = to(inputs.input_ids)
        if inputs.pending_rows is not None:  # tokens the previous launch sampled on the device
            input_ids[to(inputs.pending_rows)] = self._pending_tokens(to(inputs.pending_src))
        if self.lora is not None:
            self.lora.apply_loads(inputs.lora_loads)
        if self.graphs is not None and inputs.is_decode and self.graphs.fits(inputs):
            return self.graphs.replay(inputs, input_ids)
        if (self.prefill_graphs is not None and not inputs.is_decode and inputs.mrope_positions is None
                and inputs.lora_slot_ids is None and self.prefill_graphs.fits(inputs)):
            return self.prefill_graphs.replay(inputs, input_ids)
        if self.lora is not None:  # an eager step: each slot's rows, for every LoRA projection
            self.lora.set_rows(inputs.lora_slot_ids, self.device)
        self.ctx.meta = AttentionMetadata(
            slot_mapping=to(inputs.slot_mapping), cu_seqlens_q=to(inputs.cu_seqlens_q),
            seqlens_k=to(inputs.seqlens_k), block_tables=to(inputs.block_tables),
            max_seqlen_q=inputs.max_seqlen_q, max_seqlen_k=inputs.max_seqlen_k, is_decode=inputs.is_decode,
            has_decode_rows=inputs.is_decode or has_decode_rows(inputs.cu_seqlens_q))
        try:
            with self.layer_mode:
                if inputs.mrope_positions is not None:  # a step with image tokens
                    return self.model(input_ids, to(inputs.positions), image_embeds=image_embeds,
                                      image_rows=to(inputs.image_rows), mrope_positions=to(inputs.mrope_positions))
                return self.model(input_ids, to(inputs.positions))
        finally:
            self.ctx.meta = None

    def copy_blocks(self, inputs: StepInputs) -> None:
        """The step's copies on write: each source block's K and V, in every layer, into its destination."""
        if inputs.block_copies is None:
            return
        src, dst = self._to_device(inputs.block_copies)
        cache = self.kv_cache
        if cache.dtype.itemsize == 1:  # index_copy_ has no float8 kernels: copy the bytes
            cache = cache.view(torch.uint8)
        cache.index_copy_(2, dst, cache.index_select(2, src))

    def _pending_tokens(self, src: torch.Tensor) -> torch.Tensor:
        """The previous launch's sampled tokens at `src`; only rank 0 samples, so it sends them to the others."""
        if self.tp.rank == 0:
            tokens = self.sampler.last_tokens[src]
        else:
            tokens = torch.empty(len(src), dtype=torch.int64, device=self.device)
        return self.tp.broadcast_from_rank0(tokens)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor, inputs: StepInputs) -> torch.Tensor:
        with self.layer_mode:
            return self.model.compute_logits(self._sampled_rows(hidden, inputs))

    def _sampled_rows(self, hidden: torch.Tensor, inputs: StepInputs) -> torch.Tensor:
        index = inputs.logits_indices
        if self.device.type == "cuda":  # no host sync: under TP, rank 0 must not block on a dead peer's collective
            index = index.pin_memory().to(self.device, non_blocking=True)
        return hidden[index]

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        if self.device.type == "cuda":  # pinned and asynchronous: the host never waits for the GPU here
            return t.pin_memory().to(self.device, non_blocking=True)
        return t.to(self.device)

    def execute_model(self, inputs: StepInputs) -> "Executed":
        """Queue the step's forward pass and, where the decode graph's sampler takes its rows, the
        sampling; the handle for sample_tokens. Never waits for the device."""
        return self.execute(inputs, self.sampler.tensors(inputs))

    @torch.inference_mode()
    def execute(self, inputs: StepInputs, st: SamplingTensors | None, plan: StepSampling | None = None) -> "Executed":
        """execute_model with the step's sampling tensors (Sampler.tensors) and, under tensor parallelism,
        its plan (Sampler.plan), as the other ranks were sent it: a sharded step samples here."""
        graphs = self.graphs
        if (st is not None and graphs is not None and graphs.samples and inputs.is_decode
                and inputs.samples_every_row and inputs.prompt_rows is None and graphs.fits(inputs)):
            self.copy_blocks(inputs)
            if self.lora is not None:
                self.lora.apply_loads(inputs.lora_loads)
            if inputs.finished_request_ids:
                self._forget_images(inputs.finished_request_ids)
            tokens, logits = self.sampler.replay_graph(graphs, inputs, st)
            return Executed(st, tokens, logits)
        hidden = self.forward(inputs)
        pooled = self._pool(hidden, inputs) if inputs.num_pooled else None
        prompt = self.score_prompt(hidden, inputs)
        if st is None:
            return Executed(None, SampledTokens([]), pooled=pooled, prompt=prompt)
        if plan is not None and plan.sharded:
            return Executed(st, self.sampler.sample_shards(self.local_logits(hidden, inputs), self.tp, plan,
                                                           st.temperatures, self.model.lm_head.vocab_start),
                            pooled=pooled, prompt=prompt)
        return Executed(st, None, self.compute_logits(hidden, inputs), pooled, prompt)

    @torch.inference_mode()
    def score_prompt(self, hidden: torch.Tensor, inputs: StepInputs) -> list[torch.Tensor] | None:
        """The step's prompt logprobs (sampler.score_prompt) from the raw logits of inputs.prompt_rows,
        PROMPT_SCORE_ROWS at a time; None without such rows, and on ranks other than 0, which take part in
        the LM head's gathers only (every rank calls it, before the step's sampling)."""
        if inputs.prompt_rows is None:
            return None
        rows = self._to_device(inputs.prompt_rows)
        next_ids = None if inputs.prompt_next_ids is None else self._to_device(inputs.prompt_next_ids)
        pieces = []
        with self.layer_mode:
            for start in range(0, len(inputs.prompt_rows), PROMPT_SCORE_ROWS):
                end = start + PROMPT_SCORE_ROWS
                logits = self.model.compute_logits(hidden[rows[start:end]])
                if next_ids is not None:
                    pieces.append(score_prompt(logits, next_ids[start:end], inputs.num_prompt_top))
        if next_ids is None:
            return None
        return [torch.cat(part) for part in zip(*pieces)]

    def _pool(self, hidden: torch.Tensor, inputs: StepInputs) -> "PooledSums":
        """The sums of the step's pooled rows (embedding requests), in float32, on their way to the host."""
        rows = hidden[self._to_device(inputs.pooled_rows)].float()
        sums = torch.zeros(inputs.num_pooled, rows.shape[1], dtype=torch.float32, device=rows.device)
        return PooledSums(sums.index_add_(0, self._to_device(inputs.pooled_segments), rows))

    @torch.inference_mode()
    def sample_tokens(self, handle: "Executed", masks: GrammarMasks | None) -> SampledTokens:
        """Queue the sampling of an executed step, the masks applied to its constrained rows; its tokens
        (those the graph sampled, if it did)."""
        tokens = handle.tokens
        if tokens is None:
            with self.layer_mode:
                tokens = self.sampler.sample(handle.logits, handle.sampling, masks)
        if handle.prompt is not None:
            tokens.prompt = PromptScores(handle.prompt)
        return tokens

    @torch.inference_mode()
    def join_sampling(self, hidden: torch.Tensor, inputs: StepInputs, plan: StepSampling) -> None:
        """A rank other than 0: its part of the step's sampling collectives (rank 0 keeps the tokens)."""
        if plan.sharded:
            self.sampler.sample_shards(self.local_logits(hidden, inputs), self.tp, plan, None,
                                       self.model.lm_head.vocab_start)
        else:
            self.compute_logits(hidden, inputs)

    def local_logits(self, hidden: torch.Tensor, inputs: StepInputs) -> torch.Tensor:
        """This rank's vocabulary slice of the sampled rows' logits."""
        with self.layer_mode:
            return self.model.lm_head.local_logits(self._sampled_rows(hidden, inputs))


@dataclass
class Executed:
    """A step whose forward pass is queued: its tokens' handle where they were sampled with it, else the
    logits of its sampled rows, waiting for sample_tokens."""
    sampling: SamplingTensors | None
    tokens: SampledTokens | None
    logits: torch.Tensor | None = None
    pooled: "PooledSums | None" = None  # the embedding requests' pooled rows
    prompt: list[torch.Tensor] | None = None  # its prompt logprobs (score_prompt), where it scored any


class PooledSums:
    """A step's pooled sums [P, H] on their way to the host (engine/runner.py's PooledHandle)."""

    def __init__(self, sums: torch.Tensor):
        self.event = None
        self.sums = sums
        if sums.is_cuda:
            self.sums = torch.empty(sums.shape, dtype=sums.dtype, pin_memory=True).copy_(sums, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()

    def result(self) -> torch.Tensor:
        if self.event is not None:
            self.event.synchronize()
        return self.sums


def prefill_inputs(tokens: list[list[int]], block_size: int, blocks_per_seq: int) -> StepInputs:
    """Inputs of a batch of fresh prompts laid out in consecutive blocks (memory profiling)."""
    ids, pos, slots, cu, lens, tables = [], [], [], [0], [], []
    for i, t in enumerate(tokens):
        base = i * blocks_per_seq * block_size
        ids += t
        pos += range(len(t))
        slots += range(base, base + len(t))
        cu.append(cu[-1] + len(t))
        lens.append(len(t))
        tables.append(list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)))
    i64, i32 = torch.int64, torch.int32
    return StepInputs(torch.tensor(ids, dtype=i64), torch.tensor(pos, dtype=i64), torch.tensor(slots, dtype=i64),
                      torch.tensor(cu, dtype=i32), torch.tensor(lens, dtype=i32), torch.tensor(tables, dtype=i32),
                      max(lens), max(lens), torch.tensor([c - 1 for c in cu[1:]], dtype=i64))
