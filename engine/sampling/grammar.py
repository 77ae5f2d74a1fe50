"""Structured output on the host: a request's json_schema, regex or choice as a grammar, and each
constrained sequence's place in it. engine/sampling/grammar_mask.py takes the masks to the device.

llguidance does the work: it takes JSON schemas, regexes and Lark grammars, builds its lexer lazily (so a
compile is cheap), computes masks on the host in parallel, and has no Python dependencies, so producers
check constraints with it too (xgrammar, the other candidate, depends on torch). A constraint is

- checked without a tokenizer (`check`): what `SamplingParams` and the wire's `Sampling` run, so a job the
  client accepts compiles in the engine: compiled for a tokenizer of single bytes and followed a few bytes
  in, where llguidance meets the limits a constraint can exceed;
- compiled once per distinct constraint for the engine's tokenizer (`GrammarCache`, keyed by the
  constraint, bounded), when a request is added, or by the worker's preparation threads before a job
  reaches the engine thread (`LLMEngine.compile_grammar`);
- checked and compiled within COMPILE_BUDGET_S, each on a thread that is left behind when it overruns;
- followed per sequence (`GrammarState`): a matcher copied from one of the constraint's start matchers
  (`CompiledGrammar`) that has consumed the sequence's resolved completion tokens, each fork with its own,
  rebuilt from a fresh copy fed the completion's tokens when a sequence's recompute begins (preemption);
- masked a step at a time (`MaskFiller`): the rows' masks on llguidance's threads, beside the engine's.

In regexes and JSON-schema patterns, \\d \\w \\s (and \\D \\W \\S) are ASCII (engine/sampling/regex_classes.py).
The mask allows the tokens that keep the completion a prefix of a match, never a special token, and the
end-of-sequence tokens only where the grammar may end; a completion ends ("stop") once its grammar is
complete.
"""
from __future__ import annotations

import json
import os
import random
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from functools import lru_cache

from engine.sampling.regex_classes import ascii_regex, ascii_schema

MAX_CACHED_GRAMMARS = 256  # distinct constraints kept compiled (each a few KB to a few MB of lexer state)
# JSON as json.dumps writes it: one canonical spacing, and no whitespace runs for a model to wander into
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
MAX_ERROR_CHARS = 300
# a constraint that takes longer to check or compile fails its job (llguidance compiles most in milliseconds)
COMPILE_BUDGET_S = 10.0
# check() follows this many paths of this many bytes into a constraint: llguidance finds some constraints
# too large (a{1000000}) or endless (a recursive $ref every value must take) only once text begins
CHECK_PATHS, CHECK_BYTES = 4, 8
# a compile slower than this builds no second start matcher for the mask threads (CompiledGrammar)
SLOW_BUILD_S = 0.05
_TOO_LARGE = ("too many", "items; max is", "fuel", "too large", "too complex")  # llguidance's limits, as it words them


def grammar_of(kind: str, value) -> str:
    """llguidance's grammar for a constraint: kind is "json_schema" (a dict), "regex" or "choice" (a list);
    \\d \\w \\s as ASCII classes (engine/sampling/regex_classes.py)."""
    from llguidance import LLMatcher

    if kind == "json_schema":
        return LLMatcher.grammar_from_json_schema(ascii_schema(value), defaults=JSON_OPTIONS)
    if kind == "regex":
        return LLMatcher.grammar_from_regex(ascii_regex(value))
    # the choices as one lexeme, each a Lark string literal (JSON's escapes are Lark's): the lexer takes any
    # number of them, where as alternatives of a rule the parser takes at most 2000
    return LLMatcher.grammar_from_lark("start: CHOICE\nCHOICE: " + " | ".join(json.dumps(c, ensure_ascii=False)
                                                                           for c in value))


def check(kind: str, value) -> str:
    """Why the constraint cannot be enforced, in one line, or "" where it can: the engine's compile run for
    a tokenizer of single bytes, its first bytes followed, within COMPILE_BUDGET_S."""
    try:
        key = _key(kind, value)
    except ValueError as e:
        return str(e)
    return _checked(kind, key)


@lru_cache(maxsize=MAX_CACHED_GRAMMARS)
def _checked(kind: str, key: str) -> str:
    value = json.loads(key.partition(":")[2])
    try:
        return _run_within(COMPILE_BUDGET_S, _check, kind, value)
    except TimeoutError:
        return f"it took longer than {COMPILE_BUDGET_S:g} s to check; simplify it"


def _check(kind: str, value) -> str:
    from llguidance import LLMatcher

    try:
        grammar = grammar_of(kind, value)
    except (ValueError, TypeError) as e:
        return _one_line(str(e))
    error = LLMatcher.validate_grammar(grammar)
    if error:
        return _one_line(error)
    start = LLMatcher(_byte_tokenizer(), grammar, log_level=0)
    for path in range(CHECK_PATHS):
        error = _follow_bytes(start.deep_copy(), random.Random(path))
        if error:
            return _explain(kind, value, error)
    return ""


def _follow_bytes(matcher, rng: random.Random) -> str:
    """llguidance's error on a path of up to CHECK_BYTES bytes the matcher allows (each picked by rng), or ""."""
    for _ in range(CHECK_BYTES):
        mask = matcher.compute_bitmask()
        if matcher.is_error():
            return matcher.get_error()
        allowed = [b for b in range(256) if mask[b >> 3] >> (b & 7) & 1]
        if not allowed:
            return ""  # only the end is left
        if not matcher.consume_token(rng.choice(allowed)):
            return matcher.get_error()
    return ""


@lru_cache(maxsize=1)
def _byte_tokenizer():
    """llguidance's tokenizer of the 256 bytes and an end-of-sequence token."""
    from llguidance import LLTokenizer, TokenizerWrapper

    class Bytes:
        eos_token_id, bos_token_id, special_token_ids = 256, None, [256]
        tokens = [bytes([b]) for b in range(256)] + [b"<eos>"]

        def __call__(self, text):
            return list(text if isinstance(text, bytes) else text.encode())

    return LLTokenizer(TokenizerWrapper(Bytes()), slices=[])


def _explain(kind: str, value, error: str) -> str:
    """An error llguidance met while following a constraint, as the user's mistake."""
    cause = _one_line(error)
    endless = "Too many items" in cause or cause.startswith("NoExtension")
    if endless and kind == "json_schema" and _refers_to_itself(value, "#"):
        return ("recursive $ref with no end: every value it allows contains another (or only itself); "
                "let the recursion stop (an optional property, an anyOf with a plain case)")
    if cause.startswith("NoExtension"):
        return f"it allows no text to be generated ({cause})"
    if any(sign in cause.lower() for sign in _TOO_LARGE):
        return (f"it is too large to enforce ({cause[:120]}); use smaller repetition counts and fewer "
                "alternatives in one place")
    return cause


def _refers_to_itself(schema, path: str) -> bool:
    """Whether a $ref in `schema` (at JSON pointer `path`) points to the schema it is in, or above it."""
    if isinstance(schema, list):
        return any(_refers_to_itself(v, f"{path}/{i}") for i, v in enumerate(schema))
    if not isinstance(schema, dict):
        return False
    ref = schema.get("$ref")
    if isinstance(ref, str) and (ref == "#" or path == ref or path.startswith(ref.rstrip("/") + "/")):
        return True
    return any(_refers_to_itself(v, f"{path}/{k}") for k, v in schema.items() if k != "$ref")


def _run_within(budget_s: float, fn, *args):
    """fn(*args) on a thread of its own; TimeoutError once budget_s have passed, the thread left to finish
    (llguidance holds no GIL while it compiles) and its result dropped."""
    future: Future = Future()

    def run() -> None:
        try:
            future.set_result(fn(*args))
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            future.set_exception(e)
    threading.Thread(target=run, name="grammar-compile", daemon=True).start()
    return future.result(timeout=budget_s)


def _key(kind: str, value) -> str:
    """A constraint's identity: its kind and its value's canonical JSON; ValueError if it has none."""
    try:
        return kind + ":" + json.dumps(value, sort_keys=True, ensure_ascii=False)
    except (TypeError, ValueError) as e:
        raise ValueError(f"it is not JSON ({_one_line(str(e))})") from None


def _one_line(message: str) -> str:
    """llguidance's message, which may quote the grammar over several lines, as its cause in one line."""
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    cause = next((line for line in lines if line.startswith("error:")), lines[0] if lines else "")
    if cause.startswith("error:"):  # a regex's parse error: what is wrong, after the pattern it quotes
        cause = cause.removeprefix("error:").strip()
    return cause if len(cause) <= MAX_ERROR_CHARS else cause[: MAX_ERROR_CHARS - 3] + "..."


class GrammarCache:
    """An engine's compiled grammars for its tokenizer: one per distinct constraint, the least recently used
    dropped past MAX_CACHED_GRAMMARS. Each compiles on a thread of its own within budget_s; one that does not
    compile, or not in time, is cached with its error. Thread-safe: the worker compiles on its preparation
    threads what the engine thread then takes."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: list[int], budget_s: float = COMPILE_BUDGET_S):
        self._hf_tokenizer, self._vocab_size, self._eos = tokenizer, vocab_size, list(eos_token_ids)
        self.budget_s = budget_s
        self._tokenizer = None  # llguidance's, built on first use (about a second for a large vocabulary)
        self._compiled: OrderedDict[str, _Build] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, kind: str, value) -> "CompiledGrammar":
        """The compiled grammar of a constraint; ValueError naming the field where it cannot be enforced
        or took longer than budget_s to compile (a compile under way is waited for, not started again)."""
        key = _key(kind, value)
        with self._lock:
            build = self._compiled.get(key)
            if build is None:
                build = self._compiled[key] = _Build(self, kind, value)
                while len(self._compiled) > MAX_CACHED_GRAMMARS:
                    self._compiled.popitem(last=False)
            else:
                self._compiled.move_to_end(key)
        compiled, error = build.result()
        if error is not None:
            raise ValueError(error)
        return compiled

    def __len__(self) -> int:
        return len(self._compiled)

    def _build(self, grammar: str) -> tuple["CompiledGrammar | None", str | None]:
        from llguidance import LLMatcher

        try:
            tokenizer = self._llg_tokenizer()
        except ValueError as e:
            return None, str(e)
        began = time.monotonic()
        matcher = LLMatcher(tokenizer, grammar, log_level=0)
        if matcher.is_error():
            return None, matcher.get_error()
        first = matcher.deep_copy()
        first.compute_bitmask()  # the start's lexer states, which copies share: built here, not in a step
        if first.is_error():
            return None, first.get_error()
        slow = time.monotonic() - began > SLOW_BUILD_S
        return CompiledGrammar(matcher, lambda: LLMatcher(tokenizer, grammar, log_level=0), slow), None

    def _llg_tokenizer(self):
        with self._lock:
            if self._tokenizer is None:
                if self._hf_tokenizer is None:
                    raise ValueError("this model has no tokenizer files; json_schema, regex and choice need one")
                import llguidance.hf

                self._tokenizer = llguidance.hf.from_tokenizer(self._hf_tokenizer, n_vocab=self._vocab_size,
                                                               eos_token=self._eos)
            return self._tokenizer


class _Build:
    """One constraint's compile, on a thread of its own from its creation: its outcome, or a timeout error
    for every caller once the cache's budget has passed (a compile that ends later is dropped)."""

    def __init__(self, cache: GrammarCache, kind: str, value):
        self.kind, self.budget_s = kind, cache.budget_s
        self.deadline = time.monotonic() + cache.budget_s
        self.future: Future = Future()
        threading.Thread(target=self._run, args=(cache, kind, value), name="grammar-compile", daemon=True).start()

    def _run(self, cache: GrammarCache, kind: str, value) -> None:
        try:
            compiled, error = cache._build(grammar_of(kind, value))
        except (ValueError, TypeError) as e:
            compiled, error = None, str(e)
        except BaseException as e:  # noqa: BLE001 - a failure of llguidance's is this constraint's alone
            compiled, error = None, f"{type(e).__name__}: {e}"
        if time.monotonic() > self.deadline:
            compiled, error = None, self._late()
        elif error is not None:
            error = f"{kind} cannot be enforced: {_explain(kind, value, error)}"
        self.future.set_result((compiled, error))

    def _late(self) -> str:
        return f"the {self.kind} took longer than {self.budget_s:g} s to compile; simplify it"

    def result(self) -> tuple["CompiledGrammar | None", str | None]:
        try:
            return self.future.result(timeout=max(self.deadline - time.monotonic(), 0.0))
        except TimeoutError:
            return None, self._late()


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
    them; none beside the first where that took longer than SLOW_BUILD_S, as the engine's thread builds them),
    and a batch's rows go to the threads grouped by the matcher they were copied from."""

    def __init__(self, matcher, build, slow: bool = False):
        self._templates, self._build = [matcher], build
        self._num_templates = 1 if slow else 2 * mask_threads()
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
