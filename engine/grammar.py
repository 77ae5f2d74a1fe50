"""Structured output on the host: a request's json_schema, regex or choice as a grammar, and each
constrained sequence's place in it. engine/grammar_mask.py takes the masks to the device.

llguidance does the work: it takes JSON schemas, regexes and Lark grammars, builds its lexer lazily (so a
compile is cheap), computes masks on the host in parallel, and has no Python dependencies, so producers
check constraints with it too (xgrammar, the other candidate, depends on torch). A constraint is

- checked without a tokenizer (`check`): what `SamplingParams` and the wire's `Sampling` run, so a job the
  client accepts compiles in the engine;
- compiled once per distinct constraint for the engine's tokenizer (`GrammarCache`, keyed by the hash of
  its grammar, bounded), when a request is added, or by the worker's reader before a job reaches the
  engine thread (`LLMEngine.compile_grammar`);
- followed per sequence (`GrammarState`): a matcher copied from one of the constraint's start matchers
  (`CompiledGrammar`) that has consumed the sequence's resolved completion tokens, each fork with its own,
  rebuilt from a fresh copy fed the completion's tokens when a sequence's recompute begins (preemption);
- masked a step at a time (`MaskFiller`): the rows' masks on llguidance's threads, beside the engine's.

The mask allows the tokens that keep the completion a prefix of a match, never a special token, and the
end-of-sequence tokens only where the grammar may end; a completion ends ("stop") once its grammar is
complete.
"""
from __future__ import annotations

import hashlib
import json
import os
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from functools import lru_cache

MAX_CACHED_GRAMMARS = 256  # distinct constraints kept compiled (each a few KB to a few MB of lexer state)
# JSON as json.dumps writes it: one canonical spacing, and no whitespace runs for a model to wander into
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
MAX_ERROR_CHARS = 300


def grammar_of(kind: str, value) -> str:
    """llguidance's grammar for a constraint: kind is "json_schema" (a dict), "regex" or "choice" (a list)."""
    from llguidance import LLMatcher

    if kind == "json_schema":
        return LLMatcher.grammar_from_json_schema(value, defaults=JSON_OPTIONS)
    if kind == "regex":
        return LLMatcher.grammar_from_regex(value)
    # each choice as a Lark string literal (JSON's escapes are Lark's)
    return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in value))


def check(kind: str, value) -> str:
    """Why the constraint cannot be enforced, in one line, or "" where it can."""
    try:
        grammar = grammar_of(kind, value)
    except (ValueError, TypeError) as e:
        return _one_line(str(e))
    return _grammar_error(grammar)


@lru_cache(maxsize=MAX_CACHED_GRAMMARS)
def _grammar_error(grammar: str) -> str:
    from llguidance import LLMatcher

    return _one_line(LLMatcher.validate_grammar(grammar))


def _one_line(message: str) -> str:
    """llguidance's message, which may quote the grammar over several lines, as its cause in one line."""
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    cause = next((line for line in lines if line.startswith("error:")), lines[0] if lines else "")
    if cause.startswith("error:"):  # a regex's parse error: what is wrong, after the pattern it quotes
        cause = cause.removeprefix("error:").strip()
    return cause if len(cause) <= MAX_ERROR_CHARS else cause[: MAX_ERROR_CHARS - 3] + "..."


class GrammarCache:
    """An engine's compiled grammars for its tokenizer: one per distinct constraint (by the hash of its
    grammar), the least recently used dropped past MAX_CACHED_GRAMMARS. A constraint that does not compile
    is cached with its error. Thread-safe: the worker compiles on its reader thread what the engine thread
    then takes."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: list[int]):
        self._hf_tokenizer, self._vocab_size, self._eos = tokenizer, vocab_size, list(eos_token_ids)
        self._tokenizer = None  # llguidance's, built on first use (about a second for a large vocabulary)
        self._compiled: OrderedDict[str, tuple[CompiledGrammar | None, str | None]] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, kind: str, value) -> "CompiledGrammar":
        """The compiled grammar of a constraint; ValueError naming the field where it cannot be enforced."""
        grammar = grammar_of(kind, value)
        key = hashlib.sha256(grammar.encode()).hexdigest()
        with self._lock:
            hit = self._compiled.get(key)
            if hit is not None:
                self._compiled.move_to_end(key)
        if hit is None:
            hit = self._build(grammar)
            with self._lock:
                self._compiled[key] = hit
                while len(self._compiled) > MAX_CACHED_GRAMMARS:
                    self._compiled.popitem(last=False)
        compiled, error = hit
        if error is not None:
            raise ValueError(f"{kind} cannot be enforced: {error}")
        return compiled

    def __len__(self) -> int:
        return len(self._compiled)

    def _build(self, grammar: str) -> tuple["CompiledGrammar | None", str | None]:
        from llguidance import LLMatcher

        try:
            tokenizer = self._llg_tokenizer()
        except ValueError as e:
            return None, str(e)
        matcher = LLMatcher(tokenizer, grammar, log_level=0)
        if matcher.is_error():
            return None, _one_line(matcher.get_error())
        return CompiledGrammar(matcher, lambda: LLMatcher(tokenizer, grammar, log_level=0)), None

    def _llg_tokenizer(self):
        with self._lock:
            if self._tokenizer is None:
                if self._hf_tokenizer is None:
                    raise ValueError("this model has no tokenizer files; json_schema, regex and choice need one")
                import llguidance.hf

                self._tokenizer = llguidance.hf.from_tokenizer(self._hf_tokenizer, n_vocab=self._vocab_size,
                                                               eos_token=self._eos)
            return self._tokenizer


def mask_threads() -> int:
    """llguidance's threads for a batch's masks: every CPU of this process but one, for the engine's thread
    (which goes on beside them), at most 32."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(32, cpus - 1))


class CompiledGrammar:
    """A compiled constraint: matchers at its start, each sequence that follows it given a copy of one.

    Copies of one matcher share its lexer's lazily built states behind a lock, so the masks of copies of
    one are computed one at a time, whatever the threads. The copies are spread over twice as many
    matchers built apart as there are mask threads (about a millisecond each, built as sequences ask for
    them), and a batch's rows go to the threads grouped by the matcher they were copied from."""

    def __init__(self, matcher, build):
        self._templates, self._build = [matcher], build
        self._num_templates = 2 * mask_threads()
        self._next = 0
        self._lock = threading.Lock()

    def state(self) -> "GrammarState":
        return GrammarState(self)

    def matcher(self) -> tuple[object, int]:
        """A matcher at the start, and the index of the one it was copied from."""
        with self._lock:
            if len(self._templates) < self._num_templates:
                self._templates.append(self._build())
            i = self._next % len(self._templates)
            self._next += 1
            return self._templates[i].deep_copy(), i


class GrammarState:
    """One sequence's place in its grammar: a matcher fed its completion's resolved tokens."""

    def __init__(self, compiled: CompiledGrammar):
        self.compiled = compiled
        self.matcher = None        # built when first needed: a fork's or a recompute's is fed the completion
        self.template = 0          # the start matcher it was copied from (CompiledGrammar)
        self.num_consumed = 0      # completion tokens the matcher has consumed
        # the completion is a whole match that nothing may extend (an end-of-sequence token ended it, or the
        # grammar cannot go on): kept by follow(), read without the matcher, which may be computing a mask
        self.done = False

    def fork(self) -> "GrammarState":
        """A state of its own for a forked sequence (fed the fork's tokens when first used)."""
        return GrammarState(self.compiled)

    def restart(self) -> None:
        """Forget the matcher (its sequence is being recomputed); the next follow() feeds a fresh one."""
        self.matcher, self.num_consumed, self.done = None, 0, False

    def follow(self, completion_token_ids: list[int]) -> None:
        """Consume the completion's resolved tokens not consumed yet (a trailing -1 is still in flight).
        ValueError if the grammar refuses one (the mask allowed it, so this is never a user's mistake)."""
        num_resolved = len(completion_token_ids)
        if num_resolved and completion_token_ids[-1] < 0:
            num_resolved -= 1
        if self.matcher is None or num_resolved < self.num_consumed:
            (self.matcher, self.template), self.num_consumed, self.done = self.compiled.matcher(), 0, False
        new = completion_token_ids[self.num_consumed: num_resolved]
        if new:
            if not self.matcher.consume_tokens(new):
                raise ValueError(f"the grammar refused token {new[-1]}: {_one_line(self.matcher.get_error())}")
            self.done = self.matcher.is_stopped()
        self.num_consumed = num_resolved


class MaskFiller:
    """Computes a batch's masks on the host: the rows in parallel on llguidance's threads, each call from a
    thread of ours, so that the engine's thread goes on meanwhile (llguidance releases the GIL)."""

    CALLS = 2  # calls a step's rows are split into, in flight at once: the first computed while the next follows

    def __init__(self):
        self._executor = None
        self._threads = None

    def start(self, rows: list[tuple[GrammarState, int]], address: int, row_bytes: int,
              num_rows: int) -> Future | None:
        """Begin writing each (state, row)'s mask of allowed tokens, one bit per token id (LSB first in int32
        words), into row `row` of the num_rows x row_bytes buffer at `address`; the future it is done at.
        Until then nothing else may use those states' matchers. Returns once the computation has begun:
        a thread of ours needs the GIL to begin it, which it would otherwise get only when the caller
        next blocks."""
        if not rows:
            return None
        if self._executor is None:
            from llguidance import LLExecutor

            self._executor = LLExecutor(mask_threads())
            self._threads = ThreadPoolExecutor(self.CALLS, thread_name_prefix="grammar-masks")
        # the threads take runs of neighbouring rows: copies of one start matcher together, one thread's
        matchers = [(s.matcher, row) for s, row in sorted(rows, key=lambda r: (id(r[0].compiled), r[0].template))]
        begun = threading.Event()

        def compute():
            begun.set()
            self._executor.unsafe_compute_mask_ptr(matchers, address, row_bytes, num_rows)
        future = self._threads.submit(compute)
        begun.wait()
        return future
