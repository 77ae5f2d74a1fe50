"""Gumbel-max sampling: one token per row from softmax(logits / t), or the plain argmax where t = 0.

Grid (row, split): each program scans one contiguous column range of its row in tiles of BLOCK
columns (BLOCK // 4 groups of four, each lane of the groups a vector of its own), keeping a running best
score and its column per position, and leaves one (score, column) pair; a second tiny kernel picks each
row's best split. With a single split the first kernel writes the token itself.

Asked for (the decode graph asks), the same scan keeps an online log-sum-exp of the raw logits (the
model's distribution, no temperature) and each row's token comes with its logprob, log_softmax(logits)
[token]: one read of the logits for both. With several splits each leaves its (max, sum of exp) beside
its (score, column) and the second kernel combines them.

The noise of column c in row r is draw c % 4 of Philox(seed, counter (c // 4, r)): one Philox call
feeds four columns, and the tokens depend on (seed, row, column) only, never on the split count or
the tile size. (On CUDA the logs are lg2.approx, under the interpreter exact, so the two can part
on a near-tie.) Nothing reads device memory on the host, so sampling queues like any other kernel.

Under tensor parallelism each rank holds a slice of the columns: gumbel_best scans a slice with the
noise of the whole row's columns and returns the best score with its column, so the best over the
slices is the whole row's token.

token_logprobs gives the log-probability of given tokens, log_softmax(logits)[token], from a log-sum-exp
over the row in the same (row, split) grid: the logprobs of tokens sampled outside the Gumbel kernel, and
each tensor-parallel rank's log-sum-exp of its slice.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from engine.kernels.common import interpreted, num_sms

NO_COLUMN = tl.constexpr(2**31 - 1)  # sorts after every real column in the tie-break
SERIES_BELOW = tl.constexpr(0.05)    # v below this: -log(1 - v) from its series
DEFAULT_BLOCK = 2048
DEFAULT_WARPS = 4
INTERPRETED = interpreted()  # no libdevice under the interpreter


@triton.jit
def _log(x, FAST_LOG: tl.constexpr):
    if FAST_LOG:  # lg2.approx, not libdevice's polynomial: the two logs per element were half the work
        return libdevice.fast_logf(x)
    return tl.log(x)


@triton.jit
def _gumbel(bits, FAST_LOG: tl.constexpr):
    """Gumbel noise -log(-log(u)) with u = 1 - v, v = (bits + 0.5) / 2**32, so u lies in (0, 1).

    The winning draws have -log(u) near 0, i.e. v near 0, where a float u = 1 - v is too coarse
    and a fast log of it too inexact; there -log(u) = v + v^2/2 + ... comes from v itself. Elsewhere
    both logs take arguments where lg2.approx's absolute error (~2^-22) is far below what matters.
    """
    v = (bits.to(tl.float32) + 0.5) * 2.3283064365386963e-10
    series = v * (1.0 + v * (0.5 + v * (1.0 / 3.0 + v * (0.25 + v * (0.2 + v * (1.0 / 6.0))))))
    direct = -_log(tl.maximum(1.0 - v, 1.0e-30), FAST_LOG)
    return -_log(tl.where(v < SERIES_BELOW, series, direct), FAST_LOG)


@triton.jit
def _add_to_lse(x, top, total):
    """Logits x into a running (max, sum of exp(logit - max)) per position: one exp each, and no
    exp(-inf - -inf) while a position has seen only -inf."""
    new_top = tl.maximum(top, x)
    e = tl.exp(tl.minimum(top, x) - tl.where(new_top == float("-inf"), 0.0, new_top))
    return new_top, tl.where(x > top, total * e + 1.0, total + e)


@triton.jit
def _merge_lse(tops, totals):
    """One (max, sum of exp(x - max)) from a vector of them; log-sum-exp = max + log(sum), -inf if empty."""
    top = tl.max(tops, axis=0)
    return top, tl.sum(totals * tl.exp(tops - tl.where(top == float("-inf"), 0.0, top)), axis=0)


@triton.jit
def _lane(row_ptr, cols, start, end, inv_t, bits, best, best_col, top, total, NOISE: tl.constexpr,
          FAST_LOG: tl.constexpr, WITH_LOGPROB: tl.constexpr):
    """One lane's columns of a tile into its running best (strict: a position keeps its first maximum, and
    it sees its columns in increasing order) and, with WITH_LOGPROB, the raw logits into (top, total)."""
    inside = (cols >= start) & (cols < end)
    score = tl.load(row_ptr + cols, mask=inside, other=float("-inf")).to(tl.float32)
    if WITH_LOGPROB:
        top, total = _add_to_lse(score, top, total)
    if NOISE:
        score = score * inv_t + _gumbel(bits, FAST_LOG)
    better = score > best
    return tl.where(better, score, best), tl.where(better, cols, best_col), top, total


@triton.jit
def _merge_lanes(best, col, other, other_col):
    """The higher score of two positions, the lower column on a tie."""
    take = (other > best) | ((other == best) & (other_col < col))
    return tl.where(take, other, best), tl.where(take, other_col, col)


@triton.jit
def _scan(row_ptr, row, start, end, inv_t, seed, NOISE: tl.constexpr, GROUPS: tl.constexpr,
          FAST_LOG: tl.constexpr, WITH_LOGPROB: tl.constexpr):
    """Best (score, column) per group position over columns [start, end); scores are logits / t + noise.
    row_ptr + c is column c, so a slice starting at a column that is no multiple of 4 works too. With
    WITH_LOGPROB also each position's (max, sum of exp(logit - max)) of the raw logits, the four lanes'
    columns in one (left untouched otherwise).

    A tile is GROUPS groups of four columns; lane k of a group (column 4g + k) takes draw k of the group's
    Philox call. Each lane is its own [GROUPS] vector, in the layout the draws come in, so each call is made
    once, by the thread that holds its group. (A [GROUPS, 4] tile spread a group's columns over four threads,
    and Triton 3.6 had each of them make the group's call: 3.5x slower at 256 rows on the H100.) The lanes'
    bests are merged at the end, ties to the lower column."""
    group = tl.arange(0, GROUPS)
    b0 = tl.full([GROUPS], float("-inf"), tl.float32)
    b1, b2, b3 = b0, b0, b0
    k0 = tl.full([GROUPS], NO_COLUMN, tl.int32)
    k1, k2, k3 = k0, k0, k0
    top = tl.full([GROUPS], float("-inf"), tl.float32)
    total = tl.zeros([GROUPS], tl.float32)
    counter_row = row.to(tl.int64) << 32
    for c0 in range(start - start % 4, end, 4 * GROUPS):  # tiles start at multiples of 4, as Philox's groups
        cols = c0 + 4 * group
        if NOISE:
            r0, r1, r2, r3 = tl.randint4x(seed, counter_row + (c0 // 4 + group))
        else:  # no draws: the lanes add no noise
            r0, r1, r2, r3 = cols, cols, cols, cols
        b0, k0, top, total = _lane(row_ptr, cols, start, end, inv_t, r0, b0, k0, top, total, NOISE, FAST_LOG,
                                   WITH_LOGPROB)
        b1, k1, top, total = _lane(row_ptr, cols + 1, start, end, inv_t, r1, b1, k1, top, total, NOISE, FAST_LOG,
                                   WITH_LOGPROB)
        b2, k2, top, total = _lane(row_ptr, cols + 2, start, end, inv_t, r2, b2, k2, top, total, NOISE, FAST_LOG,
                                   WITH_LOGPROB)
        b3, k3, top, total = _lane(row_ptr, cols + 3, start, end, inv_t, r3, b3, k3, top, total, NOISE, FAST_LOG,
                                   WITH_LOGPROB)
    b0, k0 = _merge_lanes(b0, k0, b1, k1)
    b2, k2 = _merge_lanes(b2, k2, b3, k3)
    b0, k0 = _merge_lanes(b0, k0, b2, k2)
    return b0, k0, top, total


@triton.jit(do_not_specialize=["seed"])  # a fresh seed every step: no variant for seeds divisible by 16
def _gumbel_split_kernel(
    logits_ptr, temperatures_ptr, out_ptr, score_ptr, logprobs_ptr, part_ptr,
    stride_row, vocab, first_column, cols_per_split, num_splits, seed, seed_ptr,
    DIRECT: tl.constexpr, WITH_SCORE: tl.constexpr, WITH_LOGPROB: tl.constexpr, GROUPS: tl.constexpr,
    FAST_LOG: tl.constexpr, SEED_IN_MEMORY: tl.constexpr,
):
    row = tl.program_id(0)
    split = tl.program_id(1)
    if SEED_IN_MEMORY:  # a CUDA graph's step seed, written to the device before each replay
        seed = tl.load(seed_ptr)
    # columns are counted over the whole row; the tensor's column 0 is column first_column
    start = first_column + split * cols_per_split
    end = tl.minimum(start + cols_per_split, first_column + vocab)
    row_ptr = logits_ptr + row.to(tl.int64) * stride_row - first_column
    t = tl.load(temperatures_ptr + row)
    if t > 0:
        best, best_col, tops, totals = _scan(row_ptr, row, start, end, 1.0 / t, seed, True, GROUPS, FAST_LOG,
                                             WITH_LOGPROB)
    else:  # greedy: no noise, no Philox
        best, best_col, tops, totals = _scan(row_ptr, row, start, end, 1.0, seed, False, GROUPS, FAST_LOG,
                                             WITH_LOGPROB)
    top = tl.max(best, axis=None)
    # the lowest column holding the maximum, as torch.argmax; `start` when every score is -inf
    col = tl.min(tl.where(best == top, best_col, NO_COLUMN), axis=None)
    col = tl.where(col == NO_COLUMN, start, col)
    if WITH_LOGPROB:
        lse_top, lse_total = _merge_lse(tops, totals)
    if DIRECT:
        tl.store(out_ptr + row, col.to(tl.int64))
        if WITH_SCORE:
            tl.store(score_ptr + row, top)
        if WITH_LOGPROB:
            logit = tl.load(row_ptr + col).to(tl.float32)
            tl.store(logprobs_ptr + row, (logit - lse_top) - tl.log(lse_total))
    else:
        # [S, num_splits, (score bits, column) + (lse max bits, lse sum bits) with WITH_LOGPROB] int32
        part = part_ptr + (row * num_splits + split) * (4 if WITH_LOGPROB else 2)
        tl.store(part, top.to(tl.int32, bitcast=True))
        tl.store(part + 1, col)
        if WITH_LOGPROB:
            tl.store(part + 2, lse_top.to(tl.int32, bitcast=True))
            tl.store(part + 3, lse_total.to(tl.int32, bitcast=True))


@triton.jit
def _gumbel_merge_kernel(part_ptr, out_ptr, score_ptr, logits_ptr, logprobs_ptr, stride_row, num_splits,
                         SPLITS_PAD: tl.constexpr, WITH_SCORE: tl.constexpr, WITH_LOGPROB: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, SPLITS_PAD)
    mask = offs < num_splits
    part = part_ptr + (row * num_splits + offs) * (4 if WITH_LOGPROB else 2)
    score = tl.load(part, mask=mask, other=0).to(tl.float32, bitcast=True)
    score = tl.where(mask, score, float("-inf"))
    col = tl.load(part + 1, mask=mask, other=NO_COLUMN)
    top = tl.max(score, axis=0)
    token = tl.min(tl.where(score == top, col, NO_COLUMN), axis=0)
    tl.store(out_ptr + row, token.to(tl.int64))
    if WITH_SCORE:
        tl.store(score_ptr + row, top)
    if WITH_LOGPROB:  # the row's log-sum-exp from its splits'; the token's column counted from 0
        tops = tl.where(mask, tl.load(part + 2, mask=mask, other=0).to(tl.float32, bitcast=True), float("-inf"))
        totals = tl.load(part + 3, mask=mask, other=0).to(tl.float32, bitcast=True)
        lse_top, lse_total = _merge_lse(tops, totals)
        logit = tl.load(logits_ptr + row.to(tl.int64) * stride_row + token).to(tl.float32)
        tl.store(logprobs_ptr + row, (logit - lse_top) - tl.log(lse_total))


@triton.jit
def _take_pending_kernel(ids_ptr, src_ptr, tokens_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < n
    src = tl.load(src_ptr + offs, mask=inside, other=-1)
    pending = src >= 0
    token = tl.load(tokens_ptr + tl.where(pending, src, 0), mask=inside & pending, other=0)
    ids = tl.load(ids_ptr + offs, mask=inside & ~pending, other=0)
    tl.store(out_ptr + offs, tl.where(pending, token, ids), mask=inside)


def take_pending(input_ids: torch.Tensor, pending_src: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """The step's token ids [S]: input_ids, except that a row whose pending_src is an index (>= 0) takes
    tokens[pending_src], the token sampled for it by the step before, still on the device. One kernel for
    torch.where(pending_src >= 0, tokens[pending_src.clamp(min=0)], input_ids) (four)."""
    assert input_ids.shape == pending_src.shape and input_ids.dim() == 1, "input_ids and pending_src: [S] each"
    assert input_ids.dtype == tokens.dtype == torch.int64 and pending_src.dtype == torch.int64
    assert input_ids.is_contiguous() and pending_src.is_contiguous() and tokens.is_contiguous()
    out = torch.empty_like(input_ids)
    n = input_ids.shape[0]
    if n:
        block = min(1024, triton.next_power_of_2(n))
        _take_pending_kernel[(triton.cdiv(n, block),)](input_ids, pending_src, tokens, out, n, BLOCK=block,
                                                       num_warps=4)
    return out


def choose_num_splits(num_rows: int, num_tiles: int, num_sms: int) -> int:
    """About four programs per SM (one program streams its range serially), each split at least a tile."""
    return max(1, min(triton.cdiv(4 * num_sms, num_rows), num_tiles))


def gumbel_argmax(logits: torch.Tensor, temperatures: torch.Tensor, seed: int | torch.Tensor, *,
                  num_splits: int | None = None, block: int = DEFAULT_BLOCK,
                  out: torch.Tensor | None = None, logprobs_out: torch.Tensor | None = None) -> torch.Tensor:
    """Token ids [S] int64: argmax(logits / t + Gumbel noise) per row, a draw from softmax(logits / t),
    or argmax(logits) (ties to the lowest id) where t = 0.

    logits: [S, V], any float dtype, unit column stride; scores are computed in float32 (float64
    logits are compared after rounding; a NaN logit is never chosen). temperatures: [S] float32.
    The same seed gives the same tokens, whatever num_splits and block (a power of two, at least 8) are.
    seed: an int, or a one-element int64 tensor on the device read when the kernel runs (what a CUDA
    graph captures). out: a [S] int64 tensor to write the tokens into (a graph's static buffer).
    logprobs_out: a [S] float32 tensor to write each token's log_softmax(logits)[token] into (the raw
    logits' distribution, whatever t is), taken in the same pass over the logits.
    """
    return _launch(logits, temperatures, seed, 0, None, num_splits, block, out, logprobs_out)


def gumbel_best(logits: torch.Tensor, temperatures: torch.Tensor, seed: int, first_column: int, *,
                num_splits: int | None = None, block: int = DEFAULT_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """gumbel_argmax over a slice of each row's columns, whose column 0 is column `first_column` of the
    whole row: (each row's best score [S] float32, its column in the whole row [S] int64).

    The noise of a column is that of its column in the whole row, so over the slices of a row, the
    column of the highest score (ties to the lowest column) is gumbel_argmax of the whole row with the
    same seed. A score is logit / t + noise, or the logit where t = 0; -inf, with the slice's first
    column, where no column beats -inf.
    """
    scores = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
    return scores, _launch(logits, temperatures, seed, first_column, scores, num_splits, block)


def _launch(logits: torch.Tensor, temperatures: torch.Tensor, seed: int | torch.Tensor, first_column: int,
            scores: torch.Tensor | None, num_splits: int | None, block: int,
            out: torch.Tensor | None = None, logprobs: torch.Tensor | None = None) -> torch.Tensor:
    """Each row's winning column [S] int64 (counted from first_column); its score into `scores` and its
    logprob (whole rows only) into `logprobs` if given."""
    assert logits.dim() == 2 and temperatures.shape == logits.shape[:1], "logits [S, V], temperatures [S]"
    assert block >= 8 and block & (block - 1) == 0, f"block must be a power of two >= 8, got {block}"
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    num_rows, vocab = logits.shape
    if out is None:
        out = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    assert out.shape == (num_rows,) and out.dtype == torch.int64 and out.is_contiguous(), "out: [S] int64"
    with_logprob = logprobs is not None
    if with_logprob:
        assert first_column == 0, "logprobs of whole rows only"
        assert logprobs.shape == (num_rows,) and logprobs.dtype == torch.float32 and logprobs.is_contiguous(), \
            "logprobs_out: [S] float32"
    seed_in_memory = isinstance(seed, torch.Tensor)
    if seed_in_memory:
        assert seed.numel() == 1 and seed.dtype == torch.int64 and seed.device == logits.device, \
            "a seed tensor holds one int64 on the logits' device"
    if num_rows == 0 or vocab == 0:
        if scores is not None:
            scores.fill_(float("-inf"))
        if with_logprob:
            logprobs.fill_(float("nan"))  # no token to take the logprob of
        return out.fill_(first_column)
    num_tiles = triton.cdiv(vocab, block)
    if num_splits is None:
        num_splits = choose_num_splits(num_rows, num_tiles, num_sms(logits.device))
    tiles_per_split = triton.cdiv(num_tiles, max(1, min(num_splits, num_tiles)))
    num_splits = triton.cdiv(num_tiles, tiles_per_split)  # no empty split
    part = (torch.empty(num_rows, num_splits, 4 if with_logprob else 2, dtype=torch.int32, device=logits.device)
            if num_splits > 1 else out)
    if temperatures.dtype != torch.float32 or not temperatures.is_contiguous():
        temperatures = temperatures.to(torch.float32).contiguous()
    with_score = scores is not None
    _gumbel_split_kernel[(num_rows, num_splits)](
        logits, temperatures, out, scores, logprobs, part,
        logits.stride(0), vocab, first_column, tiles_per_split * block, num_splits,
        0 if seed_in_memory else seed, seed if seed_in_memory else out,
        DIRECT=num_splits == 1, WITH_SCORE=with_score, WITH_LOGPROB=with_logprob, GROUPS=block // 4,
        FAST_LOG=logits.is_cuda and not INTERPRETED, SEED_IN_MEMORY=seed_in_memory, num_warps=DEFAULT_WARPS,
    )
    if num_splits > 1:
        _gumbel_merge_kernel[(num_rows,)](part, out, scores, logits, logprobs, logits.stride(0), num_splits,
                                          SPLITS_PAD=triton.next_power_of_2(num_splits), WITH_SCORE=with_score,
                                          WITH_LOGPROB=with_logprob, num_warps=1)
    return out


LSE_BLOCK = 1024


@triton.jit
def _lse_split_kernel(logits_ptr, part_ptr, stride_row, vocab, cols_per_split, num_splits, BLOCK: tl.constexpr):
    """One split of a row: (max, sum of exp(logit - max)) over its columns, into part [S, splits, 2]."""
    row = tl.program_id(0)
    split = tl.program_id(1)
    start = split * cols_per_split
    end = tl.minimum(start + cols_per_split, vocab)
    row_ptr = logits_ptr + row.to(tl.int64) * stride_row
    offs = tl.arange(0, BLOCK)
    top = tl.full([], float("-inf"), dtype=tl.float32)
    total = tl.zeros([], dtype=tl.float32)
    for c0 in range(start, end, BLOCK):
        cols = c0 + offs
        x = tl.load(row_ptr + cols, mask=cols < end, other=float("-inf")).to(tl.float32)
        new_top = tl.maximum(top, tl.max(x, axis=0))
        shift = tl.where(new_top == float("-inf"), 0.0, new_top)  # an all -inf prefix adds nothing
        total = total * tl.exp(top - shift) + tl.sum(tl.exp(x - shift), axis=0)
        top = new_top
    part = part_ptr + (row * num_splits + split) * 2
    tl.store(part, top)
    tl.store(part + 1, total)


@triton.jit
def _token_logprob_kernel(logits_ptr, tokens_ptr, part_ptr, out_ptr, stride_row, num_splits,
                          SPLITS_PAD: tl.constexpr):
    """log_softmax(row)[token] = logit[token] - log-sum-exp of the row, from its splits' partials."""
    row = tl.program_id(0)
    offs = tl.arange(0, SPLITS_PAD)
    mask = offs < num_splits
    part = part_ptr + (row * num_splits + offs) * 2
    top, total = _merge_lse(tl.load(part, mask=mask, other=float("-inf")), tl.load(part + 1, mask=mask, other=0.0))
    token = tl.load(tokens_ptr + row)
    logit = tl.load(logits_ptr + row.to(tl.int64) * stride_row + token).to(tl.float32)
    tl.store(out_ptr + row, (logit - top) - tl.log(total))


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, *, num_splits: int | None = None,
                   block: int = LSE_BLOCK, out: torch.Tensor | None = None) -> torch.Tensor:
    """float32 [S]: log_softmax(logits[i])[token_ids[i]] for each row, the log-sum-exp in float32 whatever
    the logits' dtype. logits: [S, V], unit column stride; token_ids: [S] int64 in [0, V), on the device
    (read when the kernel runs: a CUDA graph captures it). out: a [S] float32 tensor to write into."""
    assert logits.dim() == 2 and token_ids.shape == logits.shape[:1], "logits [S, V], token_ids [S]"
    assert token_ids.dtype == torch.int64 and token_ids.is_contiguous(), "token_ids: [S] int64"
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    num_rows, vocab = logits.shape
    if out is None:
        out = torch.empty(num_rows, dtype=torch.float32, device=logits.device)
    assert out.shape == (num_rows,) and out.dtype == torch.float32 and out.is_contiguous(), "out: [S] float32"
    if num_rows == 0:
        return out
    num_tiles = triton.cdiv(vocab, block)
    if num_splits is None:
        num_splits = choose_num_splits(num_rows, num_tiles, num_sms(logits.device))
    tiles_per_split = triton.cdiv(num_tiles, max(1, min(num_splits, num_tiles)))
    num_splits = triton.cdiv(num_tiles, tiles_per_split)
    part = torch.empty(num_rows, num_splits, 2, dtype=torch.float32, device=logits.device)
    _lse_split_kernel[(num_rows, num_splits)](logits, part, logits.stride(0), vocab, tiles_per_split * block,
                                              num_splits, BLOCK=block, num_warps=DEFAULT_WARPS)
    _token_logprob_kernel[(num_rows,)](logits, token_ids, part, out, logits.stride(0), num_splits,
                                       SPLITS_PAD=triton.next_power_of_2(num_splits), num_warps=1)
    return out
