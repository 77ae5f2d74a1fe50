"""What the engine hands back: per-request outputs and per-step counts."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.sequence import Sequence, SequenceGroup


@dataclass
class CompletionOutput:
    """One completion of a request (n > 1, best_of and beam search give several)."""
    index: int
    text: str | None                      # set once finished (None without a tokenizer)
    token_ids: list[int]
    finish_reason: str | None = None      # "stop" | "length" | "abort"
    logprobs: list[dict] | None = None    # per token: {"token_id", "logprob", "top": {id: logprob}}
    cumulative_logprob: float | None = None  # the sum of its tokens' logprobs

    def __getitem__(self, key: str):
        return getattr(self, key)


@dataclass
class RequestOutput:
    """A request's output. The token and text fields are those of its first completion, `outputs[0]`."""
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]                  # every completion token so far
    new_token_ids: list[int]              # completion tokens produced in this step
    finished: bool = False
    finish_reason: str | None = None      # "stop" | "length" | "abort"
    error: str | None = None              # why the request failed on its own ("abort" with the others going on)
    text: str | None = None               # set once finished (None without a tokenizer)
    logprobs: list[dict] | None = None    # per token: {"token_id", "logprob", "top": {id: logprob}}
    cumulative_logprob: float | None = None
    outputs: list[CompletionOutput] = field(default_factory=list)  # n of them in index order (best_of, beam
    num_cached_tokens: int = 0                                      # search: best first)
    arrival_time: float = 0.0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None

    def __getitem__(self, key: str):  # outputs[i]["text"] works as in nano-vllm
        return getattr(self, key)


@dataclass
class StepStats:
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_preemptions: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    step_seconds: float = 0.0
    batch_size: int = 0


@dataclass
class StepResult:
    outputs: list[RequestOutput] = field(default_factory=list)
    stats: StepStats = field(default_factory=StepStats)

    @property
    def finished(self) -> list[RequestOutput]:
        return [o for o in self.outputs if o.finished]


def request_output(group: "SequenceGroup", tokenizer) -> RequestOutput:
    """A request's output now; token lists are the sequences' own (no copies on the hot path). Texts are
    decoded once it is finished (without an error)."""
    finished = group.is_finished
    with_text = tokenizer if finished and group.error is None else None
    if group.beam is not None:
        completions, new = _beam_completions(group, with_text), []
    else:
        completions, new = [], None
        for seq in group.seqs:
            completion, seq_new = _completion(seq, with_text)
            completions.append(completion)
            new = seq_new if new is None else new
        if finished and group.params.best_of is not None and group.error is None:
            completions.sort(key=lambda c: -c.cumulative_logprob)
            completions = completions[: group.params.n]
            for i, c in enumerate(completions):
                c.index = i
    top, first = completions[0], group.first
    return RequestOutput(
        request_id=group.request_id, prompt_token_ids=group.prompt_token_ids, token_ids=top.token_ids,
        new_token_ids=new, finished=finished, finish_reason=top.finish_reason, text=top.text, error=group.error,
        logprobs=top.logprobs, cumulative_logprob=top.cumulative_logprob, outputs=completions,
        num_cached_tokens=first.num_cached_tokens, arrival_time=first.arrival_time,
        first_scheduled_time=first.first_scheduled_time, first_token_time=first.first_token_time,
        finished_time=group.finished_time)


def _completion(seq: "Sequence", tokenizer) -> tuple[CompletionOutput, list[int]]:
    """(One sequence's completion, its tokens not reported before); its text where a tokenizer is given."""
    completion = seq.completion_token_ids
    resolved = seq.num_resolved_completion_tokens
    if resolved < len(completion):  # a placeholder is in flight: hand out the known part only
        completion = completion[:resolved]
    new = completion[seq.num_reported_tokens:]
    seq.num_reported_tokens = resolved
    text = None
    if tokenizer is not None:
        # a stop token is no part of the text; a completed grammar's last token is (an EOS there is special)
        grammar_done = seq.grammar is not None and seq.grammar.done
        text = _decode(tokenizer, completion, seq.finish_reason == "stop" and seq.stop_text_len is None
                       and not grammar_done)
        text = text if seq.stop_text_len is None else text[: seq.stop_text_len]
    return CompletionOutput(
        index=seq.index, text=text, token_ids=completion, finish_reason=seq.finish_reason,
        logprobs=list(seq.logprobs) if seq.params.logprobs is not None else None,
        cumulative_logprob=seq.cumulative_logprob), new


def _beam_completions(group: "SequenceGroup", tokenizer) -> list[CompletionOutput]:
    """The finished hypotheses, best first; or the running beams, best first, of a search cut short."""
    beam = group.beam
    if len(beam.finished) >= beam.width:
        return [CompletionOutput(index=i, token_ids=h.token_ids, finish_reason=h.finish_reason,
                                 cumulative_logprob=float(h.cumulative_logprob),
                                 text=_decode(tokenizer, h.token_ids, h.finish_reason == "stop"))
                for i, h in enumerate(beam.finished)]
    return [CompletionOutput(index=i, token_ids=s.completion_token_ids, finish_reason=s.finish_reason,
                             cumulative_logprob=s.cumulative_logprob,
                             text=_decode(tokenizer, s.completion_token_ids, False))
            for i, s in enumerate(beam.beams)]


def _decode(tokenizer, ids: list[int], drop_last: bool) -> str | None:
    """The text of `ids` (None without a tokenizer); drop_last: without the last token, a stop token."""
    if tokenizer is None:
        return None
    if ids and drop_last:
        ids = ids[:-1]
    return tokenizer.decode(ids, skip_special_tokens=True)
