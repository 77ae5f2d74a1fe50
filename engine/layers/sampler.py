"""Sampling on the device: greedy, temperature, top-k, top-p, min-p, per-request seeds, logprobs."""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from engine.layers.fusion import fused


@dataclass
class SamplingTensors:
    temperatures: torch.Tensor   # [S] float32, 0 = greedy
    top_ks: torch.Tensor         # [S] int64, vocab size = off
    top_ps: torch.Tensor         # [S] float32
    min_ps: torch.Tensor         # [S] float32
    generators: list             # [S] torch.Generator or None (None: the engine's shared stream)
    all_greedy: bool
    needs_filter: bool


@fused
def gumbel_max(logits: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
    """One pass over the logits: argmax(logits / t + Gumbel noise) samples softmax(logits / t); t=0 rows are greedy."""
    scores = logits.float()
    u = torch.rand_like(scores).clamp_(min=1e-20)
    return _gumbel_scores(scores, temperatures, u).argmax(dim=-1)


def _gumbel_scores(scores: torch.Tensor, temperatures: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """scores / t + Gumbel noise from the uniforms u in (0, 1); the scores alone in t = 0 rows."""
    t = temperatures.unsqueeze(1)
    noisy = scores / torch.where(t > 0, t, torch.ones_like(t)) - torch.log(-torch.log(u))
    return torch.where(t > 0, noisy, scores)


@functools.cache
def gumbel_kernels():
    """engine.kernels.sampling (gumbel_argmax, gumbel_best), or None where triton is missing."""
    try:
        from engine.kernels import sampling
    except ImportError:
        return None
    return sampling


def samples_by_argmax(st: SamplingTensors) -> bool:
    """Every row's token is the argmax of its own scaled, noised logits: all rows greedy, or Gumbel-max
    (no top-k / top-p / min-p filter, no request with a generator of its own)."""
    return st.all_greedy or (not st.needs_filter and all(g is None for g in st.generators))


def draw_seed(seed_gen: torch.Generator | None) -> int:
    """A seed for the Gumbel noise of one step, from a host generator (launching never waits for the device)."""
    return int(torch.randint(0, 2**31 - 1, (1,), generator=seed_gen))


def sample(logits: torch.Tensor, st: SamplingTensors, shared_gen: torch.Generator | None = None,
           seed_gen: torch.Generator | None = None) -> torch.Tensor:
    """Token ids [S] from logits [S, V] (any float dtype).

    shared_gen: the noise stream of rows without their own generator on the general path.
    seed_gen: a CPU generator that seeds the CUDA Gumbel kernel (torch's default CPU generator if None).
    """
    if st.all_greedy:
        return logits.argmax(dim=-1)
    if samples_by_argmax(st):
        if logits.is_cuda and gumbel_kernels() is not None:
            return gumbel_kernels().gumbel_argmax(logits, st.temperatures, draw_seed(seed_gen))
        return gumbel_max(logits, st.temperatures)
    logits = logits.float()
    greedy = logits.argmax(dim=-1)
    temps = torch.where(st.temperatures > 0, st.temperatures, torch.ones_like(st.temperatures))
    scores = logits / temps.unsqueeze(1)
    if st.needs_filter:
        scores = _filter(scores, st)
    probs = scores.softmax(dim=-1)
    noise = torch.empty_like(probs).exponential_(generator=shared_gen)
    for i, gen in enumerate(st.generators):
        if gen is not None:  # a seeded request draws from its own stream, whatever shares its batch
            noise[i].exponential_(generator=gen)
    # argmax of p / Exp(1) draws from p (the exponential race), without a CDF search
    sampled = (probs / noise).argmax(dim=-1)
    return torch.where(st.temperatures > 0, sampled, greedy)


def shard_best(logits: torch.Tensor, temperatures: torch.Tensor | None, seed: int, first_column: int,
               vocab_size: int) -> torch.Tensor:
    """One rank's candidate token per row, [S, 2] float64 (score, token id): the best of its vocabulary
    slice `logits` [S, n] (tokens first_column .. first_column + n - 1 of vocab_size) by logits / t +
    Gumbel noise, by the logits alone where t = 0 or `temperatures` is None (every row greedy).

    The noise of a token is the same on every rank and for every slicing (the step's seed draws it
    for the whole row), so pick_token over every rank's candidates is the unsliced sample. float64
    holds each float32 score and token id exactly.
    """
    num_rows, width = logits.shape
    if width == 0:  # a last rank holding nothing but padding
        scores = torch.full((num_rows,), float("-inf"), device=logits.device)
        ids = torch.full((num_rows,), first_column, device=logits.device)
    elif temperatures is None:
        local = logits.argmax(dim=-1)
        scores, ids = logits.gather(1, local.unsqueeze(1)).squeeze(1), local + first_column
    elif logits.is_cuda and gumbel_kernels() is not None:
        scores, ids = gumbel_kernels().gumbel_best(logits, temperatures, seed, first_column)
    else:  # every rank draws the whole row's noise and keeps its own columns
        gen = torch.Generator(device=logits.device).manual_seed(seed)
        u = torch.rand(num_rows, vocab_size, generator=gen, device=logits.device)
        u = u[:, first_column: first_column + width].clamp_(min=1e-20)
        noised = _gumbel_scores(logits.float(), temperatures, u)
        local = noised.argmax(dim=-1)
        scores, ids = noised.gather(1, local.unsqueeze(1)).squeeze(1), local + first_column
    return torch.stack([scores.double(), ids.double()], dim=1)


def pick_token(candidates: torch.Tensor) -> torch.Tensor:
    """Token ids [S] from every rank's shard_best, [ranks, S, 2]: the highest score, ties to the lowest
    token id, as argmax over the whole row. A NaN score never wins."""
    scores, ids = candidates[..., 0], candidates[..., 1]
    scores = torch.where(scores.isnan(), float("-inf"), scores)
    best = scores.max(dim=0).values
    return torch.where(scores == best, ids, float("inf")).min(dim=0).values.long()


def _filter(scores: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """Mask to -inf every token outside min-p, then top-k, then top-p of what is left."""
    if bool((st.min_ps > 0).any()):
        probs = scores.softmax(dim=-1)
        floor = st.min_ps.unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
        scores = scores.masked_fill(probs < floor, float("-inf"))
    sorted_scores, order = scores.sort(dim=-1, descending=True)
    ranks = torch.arange(scores.shape[1], device=scores.device).unsqueeze(0)
    sorted_scores = sorted_scores.masked_fill(ranks >= st.top_ks.unsqueeze(1), float("-inf"))
    sorted_probs = sorted_scores.softmax(dim=-1)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    sorted_scores = sorted_scores.masked_fill(mass_before >= st.top_ps.unsqueeze(1), float("-inf"))
    return torch.full_like(scores, float("-inf")).scatter(1, order, sorted_scores)


def compute_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, num_top: int):
    """(logprob of each sampled token [S], top-`num_top` logprobs [S, n] and their ids [S, n])."""
    logprobs = logits.float().log_softmax(dim=-1)
    chosen = logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1)
    top = logprobs.topk(num_top, dim=-1) if num_top else None
    return chosen, (top.values if top else None), (top.indices if top else None)
