"""What the engine hands back: per-request outputs and per-step counts."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.core.sequence import Sequence, SequenceGroup


@dataclass(frozen=True)
class Logprob:
    """A token's log-probability in a prompt_logprobs entry, as vLLM's: its rank in the vocabulary (1 is the
    most likely) and its text (None without a tokenizer)."""
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None

    def __getitem__(self, key: str):
        return getattr(self, key)


@dataclass
class CompletionOutput:
    """One completion of a request (n > 1, best_of and beam search give several)."""
    index: int
    text: str | None                      # set once finished (None without a tokenizer)
    token_ids: list[int]
    finish_reason: str | None = None      # "stop" | "length" | "abort"
    # per token: {"token_id", "logprob", "top": {id: logprob}}; once finished with a tokenizer, also "token"
    # (its text) and "top_logprobs" ([{token_id, token, logprob}], best first), as OpenAI's shapes need
    logprobs: list[dict] | None = None
    cumulative_logprob: float | None = None  # the sum of its tokens' logprobs
    new_token_ids: list[int] = field(default_factory=list)  # its tokens produced in this step
    new_text: str = ""                    # its text not handed out before: the pieces concatenate to `text`

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
    new_text: str = ""                    # text not handed out before (every step with add_request(stream=True)
                                          # or stop strings, else all of it once finished)
    logprobs: list[dict] | None = None    # per token: {"token_id", "logprob", "top": {id: logprob}}
    cumulative_logprob: float | None = None
    outputs: list[CompletionOutput] = field(default_factory=list)  # n of them in index order (best_of, beam
    num_cached_tokens: int = 0                                      # search: best first)
    # with prompt_logprobs, once every prompt token is scored: None for the first token, then per token
    # {token_id: Logprob} of the token itself and the top prompt_logprobs, as vLLM's; and each prompt
    # token's text (the first one's too; None without a tokenizer)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    prompt_token_texts: list[str] | None = None
    arrival_time: float = 0.0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None

    def __getitem__(self, key: str):  # outputs[i]["text"] works as in nano-vllm
        return getattr(self, key)


@dataclass
class EmbeddingOutput:
    """An embedding request's output (LLMEngine.embed, add_embed_request): it comes once, finished."""
    request_id: str
    prompt_token_ids: list[int]
    embedding: list[float] | None         # None when it was aborted or failed
    finished: bool = True
    finish_reason: str | None = "stop"    # "stop" | "abort"
    error: str | None = None
    num_cached_tokens: int = 0
    arrival_time: float = 0.0
    first_scheduled_time: float | None = None
    finished_time: float | None = None

    def __getitem__(self, key: str):
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
    whole once it is finished (without an error); each completion's new text is what its detokenizer has
    ready, or, without one, all of its text once finished."""
    finished = group.is_finished
    with_text = tokenizer if finished and group.error is None else None
    if group.beam is not None:
        completions = _beam_completions(group, with_text)
    else:
        completions = [_completion(seq, with_text, group.error is None) for seq in group.seqs]
        if group.params.best_of is not None:
            completions = _best_of(completions, group.params.n, with_text is not None)
    top, first = completions[0], group.first
    prompt_logprobs = prompt_texts = None
    if group.prompt_logprobs is not None and group.prompt_logprobs.done:
        prompt_logprobs, prompt_texts = group.prompt_logprobs.output(tokenizer)
    return RequestOutput(
        request_id=group.request_id, prompt_token_ids=group.prompt_token_ids, token_ids=top.token_ids,
        new_token_ids=top.new_token_ids, finished=finished, finish_reason=top.finish_reason, text=top.text,
        new_text=top.new_text, error=group.error, logprobs=top.logprobs, cumulative_logprob=top.cumulative_logprob,
        outputs=completions, num_cached_tokens=first.num_cached_tokens, arrival_time=first.arrival_time,
        first_scheduled_time=first.first_scheduled_time, first_token_time=first.first_token_time,
        finished_time=group.finished_time, prompt_logprobs=prompt_logprobs, prompt_token_texts=prompt_texts)


def _completion(seq: "Sequence", tokenizer, with_new_text: bool) -> CompletionOutput:
    """One sequence's completion with its tokens (and text, with_new_text) not reported before; its whole
    text where a tokenizer is given."""
    completion = seq.completion_token_ids
    resolved = seq.num_resolved_completion_tokens
    if resolved < len(completion):  # a placeholder is in flight: hand out the known part only
        completion = completion[:resolved]
    new = completion[seq.num_reported_tokens:]
    seq.num_reported_tokens = resolved
    text, new_text = _text(seq, completion, tokenizer) if with_new_text else (None, "")
    logprobs = None
    if seq.params.logprobs is not None:
        logprobs = list(seq.logprobs) if tokenizer is None else _with_token_texts(seq.logprobs, tokenizer)
    return CompletionOutput(
        index=seq.index, text=text, token_ids=completion, finish_reason=seq.finish_reason, logprobs=logprobs,
        cumulative_logprob=seq.cumulative_logprob, new_token_ids=new, new_text=new_text)


def _text(seq: "Sequence", completion: list[int], tokenizer) -> tuple[str | None, str]:
    """(Its whole text where a tokenizer is given, else None; its text not handed out before)."""
    detokenizer = seq.detokenizer
    if detokenizer is None:  # a request that needs no text as it comes: decoded once, at the end
        if tokenizer is None:
            return None, ""
        text = _decode(tokenizer, completion, _drops_last(seq))
        return text, text
    if seq.is_finished:
        detokenizer.finish(completion, len(completion) - _drops_last(seq))
    return (detokenizer.text if tokenizer is not None else None), detokenizer.take()


def _drops_last(seq: "Sequence") -> bool:
    """A stop token is no part of the text; a completed grammar's last token is (an EOS there is special)."""
    return seq.finish_reason == "stop" and not (seq.grammar is not None and seq.grammar.done)


def _best_of(completions: list[CompletionOutput], n: int, final: bool) -> list[CompletionOutput]:
    """The n of highest cumulative logprob, best first, each with all of its tokens and text as new; before
    the end (which n is not known yet) nothing is new."""
    if not final:
        for c in completions:
            c.new_token_ids, c.new_text = [], ""
        return completions
    completions.sort(key=lambda c: -c.cumulative_logprob)
    kept = completions[:n]
    for i, c in enumerate(kept):
        c.index, c.new_token_ids, c.new_text = i, c.token_ids, c.text or ""
    return kept


def _beam_completions(group: "SequenceGroup", tokenizer) -> list[CompletionOutput]:
    """The finished hypotheses, best first; or the running beams, best first, of a search cut short. Their
    text (new all at once) once the search is finished."""
    beam = group.beam
    if len(beam.finished) >= beam.width:
        hypotheses = [(h.token_ids, h.finish_reason, float(h.cumulative_logprob)) for h in beam.finished]
    else:
        hypotheses = [(s.completion_token_ids, s.finish_reason, s.cumulative_logprob) for s in beam.beams]
    completions = []
    for i, (token_ids, reason, cumulative) in enumerate(hypotheses):
        text = _decode(tokenizer, token_ids, reason == "stop")
        completions.append(CompletionOutput(index=i, token_ids=token_ids, finish_reason=reason, text=text,
                                            cumulative_logprob=cumulative, new_text=text or ""))
    return completions


def _with_token_texts(entries: list[dict], tokenizer) -> list[dict]:
    """Logprob entries with each token's text beside its id, as OpenAI's shapes need: "token", and
    "top_logprobs" as [{token_id, token, logprob}], best first."""
    ids = sorted({e["token_id"] for e in entries}.union(*(e["top"] for e in entries)))
    text = dict(zip(ids, tokenizer.batch_decode([[t] for t in ids])))  # one call for all of them
    return [{**e, "token": text[e["token_id"]],
             "top_logprobs": [{"token_id": t, "token": text[t], "logprob": lp}
                              for t, lp in sorted(e["top"].items(), key=lambda kv: -kv[1])]}
            for e in entries]


def _decode(tokenizer, ids: list[int], drop_last: bool) -> str | None:
    """The text of `ids` (None without a tokenizer); drop_last: without the last token, a stop token."""
    if tokenizer is None:
        return None
    if ids and drop_last:
        ids = ids[:-1]
    return tokenizer.decode(ids, skip_special_tokens=True)
