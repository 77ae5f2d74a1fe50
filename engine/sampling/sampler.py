"""Sampling, owned in one place: each request's sampling row and random stream, each batch's tensors, and
the path a step's tokens take (the decode graph's sampler, the logits on the host's side of the graph, or
sharded over tensor-parallel ranks). Greedy, temperature, top-k, top-p, min-p, per-request seeds, logprobs
(every sampled token's, for cumulative logprobs, and the top ones asked for), the logit adjustments
of engine/sampling/penalties.py (penalties, biases, min_tokens) and structured output's allowed-token masks
(engine/sampling/grammar_mask.py), applied on the device before sampling.

The Gumbel-max kernel (engine/kernels/sampling.py) draws where every row is the argmax of its own scaled,
noised logits; the general path (filters, seeded requests) runs torch ops on the device.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from engine.layers.fusion import fused
from engine.sampling import grammar_mask, penalties
from engine.sampling.pinned import PinnedRing


@dataclass
class SamplingTensors:
    temperatures: torch.Tensor   # [S] float32, 0 = greedy
    top_ks: torch.Tensor         # [S] int64, vocab size = off
    top_ps: torch.Tensor         # [S] float32
    min_ps: torch.Tensor         # [S] float32
    generators: list             # [S] torch.Generator or None (None: the engine's shared stream)
    all_greedy: bool
    needs_filter: bool
    num_logprobs: int = -1       # the most top logprobs a row needs, or -1
    adjust: penalties.LogitAdjustments | None = None  # penalties, biases, min_tokens of the batch's rows
    grammar: grammar_mask.GrammarRows | None = None   # constrained rows (structured output)

    @property
    def in_graph(self) -> bool:
        """Whether the decode graph's sampler can take these rows: no top logprobs, adjusted logits or
        constrained rows, and every token the argmax of its own scaled, noised logits."""
        return self.num_logprobs <= 0 and self.adjust is None and self.grammar is None and samples_by_argmax(self)


@dataclass(frozen=True)
class StepSampling:
    """How the ranks take a step's tokens; rank 0 decides it (Sampler.plan) and sends it with the step.

    Sharded: each rank picks a candidate per row from its own vocabulary slice, and the ranks all-gather
    the candidates (a few bytes a row) instead of the logits. Otherwise the LM head's slices are gathered
    and rank 0 samples the whole rows.
    """
    sharded: bool
    greedy: bool = False  # sharded, every row greedy: no temperatures, no noise
    seed: int = 0         # sharded and not greedy: the step's Gumbel noise, the same on every rank


class Sampler:
    """One per model runner (rank): the engine's random streams, each sampled sequence's state on the
    device (its random stream, its token counts) by sequence id, the batch's tensors, a step's sampling."""

    def __init__(self, device: torch.device, seed: int, vocab_size: int):
        self.device, self.vocab_size = device, vocab_size
        self.generator = torch.Generator(device=device).manual_seed(seed)  # rows without a stream of their own
        self.seed_generator = torch.Generator().manual_seed(seed)  # host-side seeds for the Gumbel kernel
        self.last_tokens = torch.empty(0, dtype=torch.int64, device=device)  # the last step's, on the device
        self.token_counts = penalties.TokenCounts(device, vocab_size)  # penalised sequences' tokens
        self.generators: dict[int, torch.Generator] = {}  # seeded sequences' random streams, by sequence id
        self.host_tokens = PinnedRing(device)  # the decode graph's tokens on their way to the host
        self._rows = None  # the SamplingRows the cached tensors were built from
        self._tensors: SamplingTensors | None = None

    def release(self) -> None:
        """Drop the device tensors kept between steps (the engine shuts down)."""
        self.last_tokens = torch.empty(0, dtype=torch.int64, device=self.device)
        self.token_counts = penalties.TokenCounts(self.device, self.vocab_size)
        self.generators = {}
        self._rows = self._tensors = None

    def forget(self, seq_ids: list[int]) -> None:
        """These sequences ended: their rows of the token counts are free again (a step still in flight
        that counts into one runs first on the device), their random streams are dropped."""
        for seq_id in seq_ids:
            self.token_counts.release(seq_id)
            self.generators.pop(seq_id, None)

    def tensors(self, inputs) -> SamplingTensors | None:
        """The tensors of the step's sampled rows (None: nothing is sampled); the same tensors again for
        the same rows (most decode steps). Frees first what the step says ended."""
        if inputs.finished_seq_ids:
            self.forget(inputs.finished_seq_ids)
        rows = inputs.sampling
        if rows is None:
            return None
        if rows is not self._rows:
            self._rows, self._tensors = rows, self._build(rows)
        st = self._tensors
        if rows.has_min_tokens:
            penalties.suppress(st.adjust, inputs.suppressed, self.device)
        return st

    def _build(self, rows) -> SamplingTensors:
        device = self.device
        return SamplingTensors(
            temperatures=penalties.on_device(rows.temperatures, torch.float32, device),
            top_ks=penalties.on_device(rows.top_ks, torch.int64, device),
            top_ps=penalties.on_device(rows.top_ps, torch.float32, device),
            min_ps=penalties.on_device(rows.min_ps, torch.float32, device),
            generators=[None if seed is None else self._stream(seq_id, seed)
                        for seq_id, seed in zip(rows.row_ids, rows.seeds)],
            all_greedy=rows.all_greedy, needs_filter=rows.needs_filter, num_logprobs=rows.num_logprobs,
            adjust=penalties.adjustments(rows, self.token_counts, device) if rows.adjusts_logits else None,
            grammar=grammar_mask.grammar_rows(rows.grammar_rows, device))

    def _stream(self, seq_id: int, seed: int) -> torch.Generator:
        """A seeded sequence's random stream, made the first time it is sampled and kept until it ends."""
        gen = self.generators.get(seq_id)
        if gen is None:
            gen = self.generators[seq_id] = torch.Generator(device=self.device).manual_seed(seed)
        return gen

    def plan(self, st: SamplingTensors | None, tp_size: int) -> StepSampling | None:
        """Rank 0: how every rank takes part in this step's sampling (None: nothing is sampled). Sharded
        where each token is the argmax of its own (scaled, noised) logits and nothing else needs whole
        rows (no top logprobs, no adjustments: the sampled tokens' own logprobs are sharded too); the seed
        comes from the host generator, as on the unsharded path."""
        if st is None:
            return None
        if tp_size == 1 or not st.in_graph:
            return StepSampling(sharded=False)
        if st.all_greedy:
            return StepSampling(sharded=True, greedy=True)
        return StepSampling(sharded=True, seed=draw_seed(self.seed_generator))

    def replay_graph(self, graphs, inputs, st: SamplingTensors) -> tuple["SampledTokens | None", torch.Tensor]:
        """A decode step as one replay of a graph that holds the LM head and the sampler: (its tokens'
        handle, None), or, for rows the graph's sampler cannot take (SamplingTensors.in_graph), (None,
        the logits) for sample()."""
        in_graph = st.in_graph
        seed = draw_seed(self.seed_generator) if in_graph and not st.all_greedy else 0  # as sample() draws
        tokens, logits = graphs.replay_sampled(inputs, st.temperatures if in_graph else None, seed,
                                               self.last_tokens)
        if not in_graph:
            return None, logits
        self.last_tokens = tokens
        return SampledTokens.of_graph(graphs.sampled, len(tokens), self.host_tokens), None

    def sample(self, logits: torch.Tensor, st: SamplingTensors, masks=None) -> "SampledTokens":
        """The step's tokens and their logprobs (and the top logprobs) from whole rows of logits [S, V];
        masks: the engine's GrammarMasks of the constrained rows (st.grammar)."""
        if st.adjust is not None or (st.grammar is not None and not grammar_mask.in_place(logits)):
            logits = logits.to(torch.float32, copy=True)  # the step's own copy to adjust
        if st.adjust is not None:
            penalties.apply(logits, st.adjust, self.token_counts)
        if st.grammar is not None:  # where in_place, into the logits as they came (a graph's buffer, refilled next step)
            grammar_mask.upload(st.grammar, masks)
            grammar_mask.apply(logits, st.grammar)
        token_ids = sample(logits, st, self.generator, self.seed_generator)
        self.last_tokens = token_ids
        if st.adjust is not None:
            self.token_counts.add(st.adjust, token_ids)
        parts = [t for t in compute_logprobs(logits, token_ids, st.num_logprobs) if t is not None]
        return SampledTokens([token_ids] + parts)

    def sample_shards(self, logits: torch.Tensor, tp, plan: StepSampling, temperatures: torch.Tensor | None,
                      first_column: int) -> "SampledTokens":
        """Token ids [S] and their logprobs from each rank's vocabulary slice (logits [S, n] of tokens
        first_column .. first_column + n - 1 of vocab_size): the best of every rank's candidates, whose
        logprobs come from each rank's log-sum-exp. temperatures: rank 0's [S]; the other ranks pass None
        and receive them (unless every row is greedy). Collective: every rank calls it."""
        if plan.greedy:
            temperatures = None
        else:  # rank 0 holds them on its device only, with no host copy to send along with the step
            if tp.rank != 0:
                temperatures = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
            temperatures = tp.broadcast_from_rank0(temperatures)
        candidates = shard_best(logits, temperatures, plan.seed, first_column, self.vocab_size)
        gathered = tp.all_gather(torch.cat([candidates, shard_logsumexp(logits, candidates, first_column)], dim=1))
        self.last_tokens = token_ids = pick_token(gathered)
        return SampledTokens([token_ids, picked_logprobs(gathered, token_ids)])


class SampledTokens:
    """Sampled ids, their logprobs (and top logprobs) on their way to the host: one device→host copy each,
    or, from the decode graph, one copy of both."""

    def __init__(self, parts: list[torch.Tensor], event: torch.cuda.Event | None = None):
        self.event = event
        self.prompt: PromptScores | None = None  # the step's prompt logprobs, where it scored prompt tokens
        if parts and parts[0].is_cuda:
            self.parts = [torch.empty(p.shape, dtype=p.dtype, pin_memory=True).copy_(p, non_blocking=True)
                          for p in parts]
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.parts = parts

    @classmethod
    def of_graph(cls, sampled: torch.Tensor, n: int, ring: PinnedRing) -> "SampledTokens":
        """The first n of the decode graph's sampled ids and their logprobs, which `sampled` holds (bytes:
        [B] int64 ids, then [B] float32 logprobs), copied to a host buffer of `ring` in one copy."""
        bs = sampled.numel() // 12
        end = 8 * bs + 4 * n
        slot, host = ring.take((end,), torch.uint8)
        host.copy_(sampled[:end], non_blocking=sampled.is_cuda)
        parts = [host[: 8 * n].view(torch.int64), host[8 * bs: end].view(torch.float32)]
        return cls(parts, ring.copied(slot))

    def result(self):
        """(token ids, (their logprobs, top logprobs or None, top ids or None)) as lists."""
        if self.event is not None:
            self.event.synchronize()
        if not self.parts:
            return [], ([], None, None)
        lists = [p.tolist() for p in self.parts]
        top = lists[2:] or [None, None]
        return lists[0], (lists[1], top[0], top[1])

    def prompt_result(self):
        """The step's prompt scores (PromptScores.result), or None where it scored none."""
        return None if self.prompt is None else self.prompt.result()


class PromptScores(SampledTokens):
    """A step's prompt logprobs (score_prompt's parts) on their way to the host."""

    def result(self):
        """(logprobs [P], ranks [P], top logprobs [P, N] or None, their ids or None) as lists."""
        if self.event is not None:
            self.event.synchronize()
        lists = [p.tolist() for p in self.parts]
        top = lists[2:] or [None, None]
        return lists[0], lists[1], top[0], top[1]


# ---- inside the decode graph (engine/execution/cuda_graphs.py) ----------------------------------------------

def graph_sampling_available() -> bool:
    """Whether a decode graph can hold the sampler: the Gumbel kernels are there (Triton)."""
    return gumbel_kernels() is not None


def take_pending(input_ids: torch.Tensor, pending_src: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """The step's token ids: rows whose pending_src is an index take the previous step's token there."""
    return gumbel_kernels().take_pending(input_ids, pending_src, tokens)


def sample_in_graph(logits: torch.Tensor, temperatures: torch.Tensor, seed: torch.Tensor, out: torch.Tensor,
                    logprobs_out: torch.Tensor) -> None:
    """Gumbel-max (greedy where t = 0) into `out` and each token's logprob into `logprobs_out`, in one pass
    over the logits; the seed read from device memory when the graph replays."""
    gumbel_kernels().gumbel_argmax(logits, temperatures, seed, out=out, logprobs_out=logprobs_out)


# ---- the sampling itself ----------------------------------------------------------------------------

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
    """(logprob of each sampled token [S], top-`num_top` logprobs [S, n] and their ids [S, n], or None
    for both where num_top <= 0)."""
    if num_top <= 0:
        return token_logprobs(logits, token_ids), None, None
    logprobs = logits.float().log_softmax(dim=-1)
    chosen = logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1)
    top = logprobs.topk(num_top, dim=-1)
    return chosen, top.values, top.indices


def score_prompt(logits: torch.Tensor, next_ids: torch.Tensor, num_top: int) -> list[torch.Tensor]:
    """Prompt logprobs from rows of raw logits [P, V] (no temperature, penalty, bias or mask: the model's own
    distribution, as vLLM reports them), each row scoring the prompt token after it, next_ids [P]: that
    token's logprob [P] float32, its rank [P] int64 (how many tokens score at least as high: 1 is the most
    likely, ties counted ahead, as vLLM ranks) and, with num_top > 0, the top num_top logprobs and their
    ids [P, num_top]."""
    logprobs = logits.float().log_softmax(dim=-1)
    chosen = logprobs.gather(1, next_ids.unsqueeze(1))
    parts = [chosen.squeeze(1), (logprobs >= chosen).sum(dim=-1)]
    if num_top > 0:
        top = logprobs.topk(num_top, dim=-1)
        parts += [top.values, top.indices]
    return parts


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """log_softmax(logits)[token] per row, float32 [S]: one pass of a kernel on CUDA, torch ops elsewhere."""
    if logits.is_cuda and gumbel_kernels() is not None:
        return gumbel_kernels().token_logprobs(logits, token_ids)
    scores = logits.float()
    return scores.gather(1, token_ids.unsqueeze(1)).squeeze(1) - scores.logsumexp(dim=-1)


def stream_seed(seed: int, index: int) -> int:
    """The seed of completion `index`'s random stream: the request's seed for the first, then a mix of
    both (splitmix64), so that requests with nearby seeds share no stream."""
    if index == 0:
        return seed
    z = (seed + index * 0x9E3779B97F4A7C15) % 2**64
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9 % 2**64
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB % 2**64
    return (z ^ (z >> 31)) >> 1


def shard_logsumexp(logits: torch.Tensor, candidates: torch.Tensor, first_column: int) -> torch.Tensor:
    """[S, 2] float64 for one rank's slice: (the logit of its candidate token, the log-sum-exp of its
    slice), -inf both where it holds nothing; picked_logprobs combines every rank's."""
    if logits.shape[1] == 0:
        return torch.full((logits.shape[0], 2), float("-inf"), dtype=torch.float64, device=logits.device)
    local = candidates[:, 1].long() - first_column
    picked = logits.gather(1, local.unsqueeze(1)).squeeze(1).float()
    if logits.is_cuda and gumbel_kernels() is not None:  # one pass, no float32 copy of the slice
        lse = picked - gumbel_kernels().token_logprobs(logits, local)
        lse = torch.where(picked == float("-inf"), picked, lse)  # an all -inf slice: nothing to add
    else:
        lse = logits.float().logsumexp(dim=-1)
    return torch.stack([picked, lse], dim=1).double()


def picked_logprobs(gathered: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """The logprob of each row's picked token, float32 [S], from every rank's [S, 4] (score, id, logit of
    its candidate, log-sum-exp of its slice) as gathered [ranks, S, 4]."""
    ids, logits, lse = gathered[..., 1], gathered[..., 2], gathered[..., 3]
    picked = torch.where(ids == token_ids.double(), logits, float("-inf")).max(dim=0).values
    return (picked - lse.logsumexp(dim=0)).float()
