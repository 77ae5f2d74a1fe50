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
    t = temperatures.unsqueeze(1)
    u = torch.rand_like(scores).clamp_(min=1e-20)
    noisy = scores / torch.where(t > 0, t, torch.ones_like(t)) - torch.log(-torch.log(u))
    return torch.where(t > 0, noisy, scores).argmax(dim=-1)


@functools.cache
def _gumbel_kernel():
    """engine.kernels.sampling.gumbel_argmax, or None where triton is missing."""
    try:
        from engine.kernels.sampling import gumbel_argmax
    except ImportError:
        return None
    return gumbel_argmax


def sample(logits: torch.Tensor, st: SamplingTensors, shared_gen: torch.Generator | None = None,
           seed_gen: torch.Generator | None = None) -> torch.Tensor:
    """Token ids [S] from logits [S, V] (any float dtype).

    shared_gen: the noise stream of rows without their own generator on the general path.
    seed_gen: a CPU generator that seeds the CUDA Gumbel kernel (torch's default CPU generator if None).
    """
    if st.all_greedy:
        return logits.argmax(dim=-1)
    if not st.needs_filter and all(g is None for g in st.generators):
        if logits.is_cuda and _gumbel_kernel() is not None:
            # the seed comes from the host, so launching the kernel never waits for the device
            seed = int(torch.randint(0, 2**31 - 1, (1,), generator=seed_gen))
            return _gumbel_kernel()(logits, st.temperatures, seed)
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
