"""The boundary between the engine loop and execution on the device.

The engine describes a step in plain data (StepInputs: tensors and lists, never a Sequence) and drives
a Runner through it: execute_model(inputs) queues the forward pass (and, where the decode graph can
take it, the sampling) and returns a handle; the engine computes structured output's masks on the
host meanwhile; sample_tokens(handle, masks) queues the sampling and returns the tokens' handle, which
the engine collects later. The runner is called and never calls back. ModelRunner (one device, one
rank) and TPDriver (tensor parallelism) implement it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch


@dataclass
class ImageSlice:
    """The image tokens of one sequence in one step: embeddings offset .. offset + length - 1 of an
    image of num_tokens tokens, placed at input rows row .. row + length - 1. The runner keeps each
    image's embeddings by key from the first step that needs them to the one that passes its last token."""
    key: tuple[str, int]      # (request id, image index)
    pixel_values: np.ndarray  # the image's patches, encoded where the runner holds no embeddings for key
    grid: tuple[int, int, int]
    num_tokens: int
    row: int
    offset: int
    length: int

    @property
    def is_last(self) -> bool:
        return self.offset + self.length == self.num_tokens


@dataclass
class SamplingRows:
    """The sampling settings of a step's sampled rows, in row order. The engine hands the same object
    again while the rows are the same sequences (most decode steps), so the runner keeps its tensors."""
    row_ids: list[int]               # each row's sequence id: the key of its state on the device
    temperatures: list[float]        # 0 = greedy
    top_ks: list[int]                # vocab size = off
    top_ps: list[float]
    min_ps: list[float]
    seeds: list[int | None]          # a seeded row's random stream seed
    num_logprobs: int                # the most top logprobs a row needs, or -1
    all_greedy: bool
    needs_filter: bool               # a sampled row has a top-k, top-p or min-p filter
    penalties: list[tuple[int, float, float, float]] = field(default_factory=list)  # (row, repetition,
    # frequency, presence) of each penalised row
    prompts: list[list[int]] = field(default_factory=list)  # each penalised row's prompt token ids
    biases: list[tuple[int, int, float]] = field(default_factory=list)  # (row, token id, bias)
    has_min_tokens: bool = False     # a row may have its stop tokens masked (StepInputs.suppressed)
    grammar_rows: list[int] = field(default_factory=list)  # constrained rows (structured output)

    @property
    def adjusts_logits(self) -> bool:
        return bool(self.penalties or self.biases or self.has_min_tokens)


@dataclass
class StepInputs:
    """One step as the runner takes it: what the forward pass needs (CPU tensors; what rank 0 sends to
    the other ranks), what its sampling needs, and what ended since the last step."""
    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    cu_seqlens_q: torch.Tensor
    seqlens_k: torch.Tensor
    block_tables: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    logits_indices: torch.Tensor  # rows of the hidden states to sample from
    # input rows whose token is still being sampled by the previous launch, and where it will be
    pending_rows: torch.Tensor | None = None
    pending_src: torch.Tensor | None = None
    block_copies: torch.Tensor | None = None  # [2, C]: KV blocks copied (source row 0 to destination row 1) first
    # a step with image tokens (vision-language models): M-RoPE's three position streams [3, T], the image
    # tokens' input rows and where their embeddings come from
    mrope_positions: torch.Tensor | None = None
    image_rows: torch.Tensor | None = None
    images: list[ImageSlice] = field(default_factory=list)
    sampling: SamplingRows | None = None  # None: nothing is sampled
    # embedding sequences' rows to pool (engine/core/pooling.py): the hidden states of input rows pooled_rows,
    # summed in float32 into num_pooled vectors, row i into vector pooled_segments[i] (ascending)
    pooled_rows: torch.Tensor | None = None
    pooled_segments: torch.Tensor | None = None
    num_pooled: int = 0
    suppressed: list[tuple[int, int]] = field(default_factory=list)  # (row, token): min_tokens' masked stops
    finished_seq_ids: list[int] = field(default_factory=list)        # their sampling state is freed
    finished_request_ids: list[str] = field(default_factory=list)    # their images' embeddings are freed
    # prompt logprobs: input rows whose raw logits score the prompt token after them (every rank computes
    # their logits), and rank 0's: those tokens and the most top logprobs a row asks for
    prompt_rows: torch.Tensor | None = None
    prompt_next_ids: torch.Tensor | None = None
    num_prompt_top: int = 0
    # LoRA adapters (engine/lora/): each input row's adapter slot (-1: the base model; None: no row has one), and
    # the adapters to load into their slots before the forward pass: (slot, int_id, name, path)
    lora_slot_ids: torch.Tensor | None = None
    lora_loads: list[tuple[int, int, str, str]] = field(default_factory=list)

    @property
    def is_decode(self) -> bool:
        return self.max_seqlen_q == 1

    @property
    def samples_every_row(self) -> bool:
        """One sampled row per input row, in order (what the decode graph's sampler takes)."""
        return len(self.logits_indices) == len(self.input_ids)


@dataclass
class GrammarMasks:
    """A step's allowed-token masks of its constrained rows, on the host: bitmask [R, ceil(V / 32)] int32,
    in a buffer of `ring` (slot), which the runner marks when it queued the copy to the device."""
    bitmask: torch.Tensor
    ring: object  # engine.pinned.PinnedRing
    slot: int


class TokensHandle(Protocol):
    def result(self) -> tuple[list[int], tuple]:
        """(token ids, (their logprobs, top logprobs or None, top ids or None)), waiting for the device."""

    def prompt_result(self) -> tuple[list, list, list | None, list | None] | None:
        """The step's prompt logprobs, one per StepInputs.prompt_rows row: (logprobs, ranks, top logprobs
        or None, top ids or None), waiting for the device; None where the step scored no prompt token."""


class PooledHandle(Protocol):
    def result(self) -> torch.Tensor:
        """The step's pooled sums [num_pooled, hidden size], float32 on the host, waiting for the device."""


class Runner(Protocol):
    """What the engine calls to run steps; see the module's docstring."""

    device: torch.device
    num_kvcache_blocks: int
    uses_mrope: bool
    has_lm_head: bool  # False: an embedding checkpoint without one (it cannot generate)
    lora_modules: frozenset[str]  # the projections a LoRA adapter may adapt (engine/lora/layers.py), by name

    def execute_model(self, inputs: StepInputs) -> object:
        """Queue the step's forward pass (and the sampling where it can run with it); a handle for
        sample_tokens, whose `pooled` is a PooledHandle of the step's pooled rows (None without)."""

    def sample_tokens(self, handle: object, masks: GrammarMasks | None) -> TokensHandle:
        """Queue the sampling of an executed step (nothing where it already ran), with the masks of its
        constrained rows; the tokens' handle."""

    def shutdown(self) -> None:
        """Release the devices; no step after it."""
