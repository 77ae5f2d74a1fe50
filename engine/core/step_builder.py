"""Turns a scheduled batch of sequences into the runner's plain StepInputs (engine/runner.py): the
forward pass's tensors, the image tokens' sources, the sampled rows' settings and what ended since the
last step. Everything a step reads of a Sequence is read here, on the engine's side of the boundary."""
from __future__ import annotations

import numpy as np
import torch

from engine.core.pooling import pooled_positions
from engine.core.scheduler import ScheduledBatch
from engine.core.sequence import Sequence
from engine.runner import ImageSlice, SamplingRows, StepInputs
from engine.sampling.sampler import stream_seed


class StepBuilder:
    """One per engine: builds each step's StepInputs, keeping the sampled rows' settings while the
    rows are the same sequences."""

    def __init__(self, block_size: int, uses_mrope: bool, vocab_size: int, eos_token_ids: list[int],
                 long_rope_row: int = 0):
        """long_rope_row: LongRoPE's row of position 0 in the long half of the rotary tables, which a sequence
        with Sequence.long_rope reads (layers/rotary.py); 0 for other ropes."""
        self.block_size, self.uses_mrope = block_size, uses_mrope
        self.long_rope_row = long_rope_row
        self.vocab_size, self.eos_token_ids = vocab_size, list(eos_token_ids)
        self._row_ids: list[int] = []
        self._rows: SamplingRows | None = None
        self.finished_seq_ids: list[int] = []      # ended since the last step, told to the runner with the next
        self.finished_request_ids: list[str] = []  # the same for requests with images

    def finished(self, seq: Sequence) -> None:
        """`seq` ended: the next step tells the runner to free what it holds for it."""
        self.finished_seq_ids.append(seq.seq_id)
        if seq.multimodal is not None:
            self.finished_request_ids.append(seq.request_id)

    def build(self, batch: ScheduledBatch, sampled: list[Sequence], scored: list = ()) -> StepInputs:
        """The step's inputs, before the engine advances its sequences; scored: its sequences' rows that score
        prompt tokens (engine/core/prompt_logprobs.py's prompt_spans)."""
        inputs = self._forward_inputs(batch, scored)
        if batch.lora_loads:
            inputs.lora_loads = batch.lora_loads
        if any(s.lora is not None for s in batch.seqs):
            slot_ids = np.array([s.lora_slot if s.lora is not None else -1 for s in batch.seqs], dtype=np.int64)
            inputs.lora_slot_ids = torch.from_numpy(np.repeat(slot_ids, batch.num_tokens))
        if batch.block_copies:
            inputs.block_copies = torch.tensor(batch.block_copies, dtype=torch.int64).T.contiguous()
        if sampled:
            inputs.sampling = self._sampling_rows(sampled)
            if inputs.sampling.has_min_tokens:
                inputs.suppressed = self._suppressed(sampled)
        if self.finished_seq_ids:
            inputs.finished_seq_ids, self.finished_seq_ids = self.finished_seq_ids, []
        if self.finished_request_ids:
            inputs.finished_request_ids, self.finished_request_ids = sorted(set(self.finished_request_ids)), []
        return inputs

    # ---- the forward pass -------------------------------------------------------------------------

    def _forward_inputs(self, batch: ScheduledBatch, scored: list) -> StepInputs:
        seqs, counts = batch.seqs, batch.num_tokens
        if (not batch.forks and all(n == 1 for n in counts)
                and all(s.num_uncomputed_tokens == 1 and s.pooling is None for s in seqs)):
            return self._decode_inputs(batch)
        # per sequence in Python, per token in numpy (a prefill step carries thousands of tokens)
        starts = [s.num_computed_tokens for s in seqs]
        input_ids: list[int] = []
        logits_indices: list[int] = []
        pending_rows, pending_src = [], []
        pooled_rows, pooled_segments = [], []
        row = 0  # the sequence's first input row
        for seq, start, n in zip(seqs, starts, counts):
            end = start + n
            if seq.pooling is not None:  # an embedding request: its rows are pooled, never sampled
                pooled = pooled_positions(seq.pooling.pooling.method, start, end, seq.num_tokens)
                if pooled:
                    pooled_segments += [pooled_segments[-1] + 1 if pooled_segments else 0] * len(pooled)
                    pooled_rows += range(row + pooled.start - start, row + pooled.stop - start)
            if end == seq.num_tokens and seq.token_ids[-1] < 0:
                pending_rows.append(row + n - 1)
                pending_src.append(seq.pending_index)
            input_ids.extend(seq.token_ids[start:end])
            row += n
            if end == seq.num_tokens and seq.pooling is None:  # sampled, once for it and each forked from it
                logits_indices += [row - 1] * (1 + len(batch.forks.get(seq.seq_id, ())))
        lengths = np.array(counts, dtype=np.int64)
        cu_q = np.zeros(len(seqs) + 1, dtype=np.int64)
        np.cumsum(lengths, out=cu_q[1:])
        lens_k = np.array(starts, dtype=np.int64) + lengths
        owner = np.repeat(np.arange(len(seqs)), lengths)  # each input row's sequence
        positions = np.arange(row, dtype=np.int64) + np.repeat(lens_k - lengths - cu_q[:-1], lengths)
        width = max(len(s.block_table) for s in seqs)
        tables = np.array([s.block_table + [-1] * (width - len(s.block_table)) for s in seqs], dtype=np.int64)
        slots = tables[owner, positions // self.block_size] * self.block_size + positions % self.block_size
        if self.long_rope_row:
            positions += np.repeat(np.array([self.long_rope_row if s.long_rope else 0 for s in seqs]), lengths)
        inputs = StepInputs(
            input_ids=torch.from_numpy(np.array(input_ids, dtype=np.int64)),
            positions=torch.from_numpy(positions),
            slot_mapping=torch.from_numpy(slots),
            cu_seqlens_q=torch.from_numpy(cu_q.astype(np.int32)),
            seqlens_k=torch.from_numpy(lens_k.astype(np.int32)),
            block_tables=torch.from_numpy(tables.astype(np.int32)),
            max_seqlen_q=max(counts), max_seqlen_k=int(lens_k.max()),
            logits_indices=torch.tensor(logits_indices, dtype=torch.int64),
            **_pending(pending_rows, pending_src))
        if pooled_rows:
            inputs.pooled_rows = torch.tensor(pooled_rows, dtype=torch.int64)
            inputs.pooled_segments = torch.tensor(pooled_segments, dtype=torch.int64)
            inputs.num_pooled = pooled_segments[-1] + 1
        if scored:
            _score_prompts(inputs, scored, cu_q.tolist())
        if self.uses_mrope and any(s.multimodal is not None for s in seqs):
            _place_images(batch, inputs)
        return inputs

    def _decode_inputs(self, batch: ScheduledBatch) -> StepInputs:
        """The inputs of one new token per sequence: the hot path of long generations."""
        seqs, bs = batch.seqs, self.block_size
        lens = [s.num_tokens for s in seqs]
        slots = [s.block_table[(n - 1) // bs] * bs + (n - 1) % bs for s, n in zip(seqs, lens)]
        width = max(len(s.block_table) for s in seqs)
        tables = [s.block_table + [-1] * (width - len(s.block_table)) for s in seqs]
        i64 = torch.int64
        pending_rows = [i for i, s in enumerate(seqs) if s.token_ids[-1] < 0]
        if self.uses_mrope:
            positions = torch.tensor([n - 1 + s.mrope_position_delta for s, n in zip(seqs, lens)], dtype=i64)
        elif self.long_rope_row:
            positions = torch.tensor([n - 1 + (self.long_rope_row if s.long_rope else 0) for s, n in zip(seqs, lens)],
                                     dtype=i64)
        else:
            positions = torch.tensor([n - 1 for n in lens], dtype=i64)
        return StepInputs(
            input_ids=torch.tensor([s.token_ids[-1] for s in seqs], dtype=i64),
            positions=positions,
            slot_mapping=torch.tensor(slots, dtype=i64),
            cu_seqlens_q=torch.arange(len(seqs) + 1, dtype=torch.int32),
            seqlens_k=torch.tensor(lens, dtype=torch.int32),
            block_tables=torch.tensor(tables, dtype=torch.int32),
            max_seqlen_q=1, max_seqlen_k=max(lens),
            logits_indices=torch.arange(len(seqs), dtype=i64),
            **_pending(pending_rows, [seqs[i].pending_index for i in pending_rows]))

    # ---- sampling ---------------------------------------------------------------------------------

    def _sampling_rows(self, seqs: list[Sequence]) -> SamplingRows:
        ids = [s.seq_id for s in seqs]
        if ids != self._row_ids:
            self._row_ids, self._rows = ids, sampling_rows(seqs, self.vocab_size)
        return self._rows

    def _suppressed(self, seqs: list[Sequence]) -> list[tuple[int, int]]:
        """This step's (row, stop token) pairs to mask: those of each row still short of its min_tokens."""
        pairs = []
        for i, s in enumerate(seqs):
            p = s.params
            if s.num_completion_tokens < p.min_tokens:
                stops = set(p.stop_token_ids) | (set() if p.ignore_eos else set(self.eos_token_ids))
                pairs += [(i, t) for t in sorted(stops) if t < self.vocab_size]
        return pairs


def sampling_rows(seqs: list[Sequence], vocab_size: int) -> SamplingRows:
    """The sampling settings of sampled rows `seqs`, from their params (beam search: the candidates'
    top logprobs too)."""
    ps = [s.params for s in seqs]
    top_ks = [min(p.top_k, vocab_size) if p.top_k > 0 else vocab_size for p in ps]
    seeds = [stream_seed(p.seed, s.index) if p.seed is not None and not p.greedy else None
             for s, p in zip(seqs, ps)]
    num_top = [max(s.group.beam.num_candidates if s.group is not None and s.group.beam is not None else -1,
                   -1 if p.logprobs is None else p.logprobs) for s, p in zip(seqs, ps)]
    penalised = [(i, s) for i, s in enumerate(seqs) if s.params.penalises]
    return SamplingRows(
        row_ids=[s.seq_id for s in seqs], temperatures=[p.temperature for p in ps], top_ks=top_ks,
        top_ps=[p.top_p for p in ps], min_ps=[p.min_p for p in ps], seeds=seeds, num_logprobs=max(num_top),
        all_greedy=all(p.greedy for p in ps),
        needs_filter=any(not p.greedy and (p.top_k > 0 or p.top_p < 1 or p.min_p > 0) for p in ps),
        penalties=[(i, s.params.repetition_penalty, s.params.frequency_penalty, s.params.presence_penalty)
                   for i, s in penalised],
        prompts=[s.prompt_token_ids for _, s in penalised],
        biases=[(i, t, b) for i, p in enumerate(ps) for t, b in (p.logit_bias or {}).items()],
        has_min_tokens=any(p.min_tokens > 0 for p in ps),
        grammar_rows=[i for i, s in enumerate(seqs) if s.grammar is not None])


def _pending(rows: list[int], src: list[int]) -> dict:
    if not rows:
        return {}
    return {"pending_rows": torch.tensor(rows, dtype=torch.int64), "pending_src": torch.tensor(src, dtype=torch.int64)}


def _score_prompts(inputs: StepInputs, spans: list, cu_q: list[int]) -> None:
    """The input rows that score prompt tokens (prompt_logprobs), the tokens they score and the most top
    logprobs one asks for."""
    rows, next_ids = [], []
    for i, seq, start, count in spans:
        rows += range(cu_q[i], cu_q[i] + count)
        next_ids += seq.prompt_token_ids[start + 1:start + 1 + count]
    inputs.prompt_rows = torch.tensor(rows, dtype=torch.int64)
    inputs.prompt_next_ids = torch.tensor(next_ids, dtype=torch.int64)
    inputs.num_prompt_top = max(seq.group.prompt_logprobs.num_top for _, seq, _, _ in spans)


def _place_images(batch: ScheduledBatch, inputs: StepInputs) -> None:
    """The positions of sequences with images (their M-RoPE streams; one row where the step has no image
    token, since text's three streams are equal) and, for image tokens, where their embeddings come from
    (ImageSlice: the runner runs the vision tower on an image when a chunk first reaches its tokens)."""
    pos3 = np.broadcast_to(inputs.positions.numpy(), (3, len(inputs.positions))).copy()
    row, images = 0, []
    for seq, n in zip(batch.seqs, batch.num_tokens):
        mm, start = seq.multimodal, seq.num_computed_tokens
        if mm is not None:
            pos3[:, row:row + n] = mm.positions(start, start + n)
            for i in mm.images_in(start, start + n):
                first, length = mm.vision_placeholders[i]
                a, b = max(start, first), min(start + n, first + length)
                pixels = mm.pixel_values[mm.patch_offsets[i]:mm.patch_offsets[i + 1]].numpy()
                images.append(ImageSlice((seq.request_id, i), pixels, mm.image_grid_thw[i], length,
                                         row + a - start, a - first, b - a))
        row += n
    inputs.positions = torch.from_numpy(pos3[0].copy())
    if not images:
        return
    inputs.mrope_positions = torch.from_numpy(pos3)
    inputs.images = images
    inputs.image_rows = torch.cat([torch.arange(s.row, s.row + s.length) for s in images])
