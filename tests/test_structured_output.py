"""Structured output in the engine: every completion under json_schema, regex or choice matches it (unless
it ends by length, and then it is a prefix of a match), in batches shared with unconstrained requests; greedy
constrained output is the masked greedy of transformers' logits under llguidance's own mask; n > 1, stop
strings, preemption, the prefix cache, async scheduling; bad constraints are one-line errors."""
from __future__ import annotations

import json
import re
import threading

import jsonschema
import llguidance
import llguidance.hf
import llguidance.numpy
import numpy as np
import pytest
import torch

from engine import LLM, SamplingParams
from engine.builtin import TINY_MODEL_DIR
from engine.sampling.grammar import MAX_CACHED_GRAMMARS, grammar_of
from tests.breadth_helpers import load_hf

SCHEMAS = {
    "nested": {"type": "object", "additionalProperties": False, "required": ["user", "active"], "properties": {
        "user": {"type": "object", "additionalProperties": False, "required": ["id", "name"], "properties": {
            "id": {"type": "integer", "minimum": 1, "maximum": 999}, "name": {"type": "string", "maxLength": 6}}},
        "active": {"type": "boolean"}}},
    "array": {"type": "object", "additionalProperties": False, "required": ["scores"], "properties": {
        "scores": {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5},
                   "minItems": 2, "maxItems": 4}}},
    "enums": {"type": "object", "additionalProperties": False, "required": ["color", "size"], "properties": {
        "color": {"enum": ["red", "green", "blue"]}, "size": {"type": "string", "enum": ["S", "M", "L"]}}},
    "pattern": {"type": "object", "additionalProperties": False, "required": ["code"], "properties": {
        "code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"}, "note": {"type": "string", "maxLength": 4}}},
    "optional": {"type": "object", "additionalProperties": False, "properties": {
        "a": {"type": "integer", "minimum": 0, "maximum": 9}, "b": {"type": "boolean"}, "c": {"type": "null"}}},
    "list": {"type": "array", "items": {"enum": [1, 2, 3]}, "minItems": 1, "maxItems": 3},
}
REGEXES = [r"[0-9]{3}-[a-z]{2,4}", r"(yes|no), because [a-z ]{1,12}\.", r"#[0-9a-f]{6}"]
CHOICES = [["positive", "negative", "neutral"], ["A", "B", "C", "D"], ["no", "not sure", "nothing"]]
SPECIAL = {0, 1}       # the tiny tokenizer's <|endoftext|> and <|im_start|>; <|im_end|> (2) is its EOS
TOKENIZER_SIZE = 509   # the model's vocabulary is 512: ids 509..511 are no token at all
MAX_TOKENS = 160


def constraints() -> list[dict]:
    return ([{"json_schema": s} for s in SCHEMAS.values()] + [{"regex": r} for r in REGEXES]
            + [{"choice": c} for c in CHOICES])


def check_completion(llm, constraint: dict, completion) -> None:
    """A stop ending matches the constraint; a length ending is a prefix of a match. Never a special token,
    nor an id outside the tokenizer; an EOS only as the last token."""
    ids = completion.token_ids
    assert not SPECIAL & set(ids) and max(ids) < TOKENIZER_SIZE
    assert 2 not in ids[:-1]
    (kind, value), = constraint.items()
    if completion.finish_reason == "length":
        assert len(ids) == MAX_TOKENS
        matcher = llm.grammars.compile(kind, value).matcher()
        assert matcher.consume_tokens(ids), completion.text
        return
    assert completion.finish_reason == "stop"
    if kind == "json_schema":
        jsonschema.validate(json.loads(completion.text), value)
    elif kind == "regex":
        assert re.fullmatch(value, completion.text), completion.text
    else:
        assert completion.text in value


@pytest.fixture(scope="module", params=["tiny", "checkpoint"])
def model_dir(request, qwen3_checkpoint):
    return TINY_MODEL_DIR if request.param == "tiny" else str(qwen3_checkpoint)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_sampled_completions_match_their_constraints_in_batches_shared_with_free_ones(model_dir, async_scheduling):
    llm = LLM(model_dir, load_format="dummy" if model_dir == TINY_MODEL_DIR else "auto", device="cpu",
              max_num_seqs=64, max_model_len=256, async_scheduling=async_scheduling)
    # each constraint under several samplers: plain, filtered, penalised, biased towards a token the
    # grammars never allow at the start ("!"), seeded with n=2; free requests between them
    samplers = [dict(temperature=1.0), dict(temperature=0.7, top_p=0.9, top_k=50), dict(temperature=1.3, min_p=0.05),
                dict(temperature=1.0, presence_penalty=1.0, repetition_penalty=1.2),
                dict(temperature=1.0, logit_bias={3: 100.0}), dict(temperature=1.0, n=2, seed=5)]
    prompts, params, asked = [], [], []
    for i, constraint in enumerate(constraints() * 15):
        sampler = samplers[i % len(samplers)]
        prompts.append(f"Request {i}: answer in the format asked.")
        params.append(SamplingParams(max_tokens=MAX_TOKENS, **sampler, **constraint))
        asked.append(constraint)
        if i % 3 == 0:
            prompts.append(f"Free request {i}")
            params.append(SamplingParams(max_tokens=20, temperature=1.0))
            asked.append(None)
    outs = llm.generate(prompts, params, use_tqdm=False)
    endings = []
    for out, constraint in zip(outs, asked):
        if constraint is None:
            assert len(out.token_ids) == 20 or out.finish_reason == "stop"
            continue
        for completion in out.outputs:
            check_completion(llm, constraint, completion)
            endings.append(completion.finish_reason)
    assert len(endings) >= 200 and endings.count("stop") >= 0.9 * len(endings)
    assert len(llm.grammars) == len(constraints())  # compiled once per distinct constraint
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks


def masked_greedy(model, tokenizer, prompt: list[int], kind: str, value, max_tokens: int) -> list[int]:
    """The reference: at each step transformers' logits, llguidance's mask for the tokens so far, argmax."""
    matcher = llguidance.LLMatcher(tokenizer, grammar_of(kind, value), log_level=0)
    bitmask = llguidance.numpy.allocate_token_bitmask(1, 512)
    ids: list[int] = []
    with torch.no_grad():
        while len(ids) < max_tokens and not matcher.is_stopped():
            logits = model(torch.tensor([prompt + ids])).logits[0, -1].numpy().copy()[None]
            llguidance.numpy.fill_next_token_bitmask(matcher, bitmask)
            llguidance.numpy.apply_token_bitmask_inplace(logits, bitmask)
            ids.append(int(np.argmax(logits[0])))
            assert matcher.consume_token(ids[-1])
    return ids


@pytest.fixture(scope="module")
def reference(qwen3_checkpoint):
    from transformers import AutoTokenizer

    tokenizer = llguidance.hf.from_tokenizer(AutoTokenizer.from_pretrained(qwen3_checkpoint), n_vocab=512,
                                             eos_token=2)
    return load_hf(qwen3_checkpoint), tokenizer, {}


GREEDY_CASES = [("json_schema", SCHEMAS["nested"]), ("json_schema", SCHEMAS["array"]),
                ("json_schema", SCHEMAS["optional"]), ("regex", REGEXES[1]), ("choice", CHOICES[2])]
GREEDY_PROMPTS = [[5, 17, 300, 42], [7] * 11, [100, 200, 300, 400, 5, 6, 7, 8, 9]]


def expected_greedy(reference, prompt, kind, value, max_tokens=48):
    model, tokenizer, cache = reference
    key = (tuple(prompt), kind, json.dumps(value))
    if key not in cache:
        cache[key] = masked_greedy(model, tokenizer, prompt, kind, value, max_tokens)
    return cache[key]


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_greedy_constrained_output_is_the_masked_greedy_of_transformers_logits(qwen3_checkpoint, reference,
                                                                               async_scheduling):
    llm = LLM(str(qwen3_checkpoint), device="cpu", kvcache_block_size=8, async_scheduling=async_scheduling)
    prompts, params, cases = [], [], []
    for kind, value in GREEDY_CASES:
        for prompt in GREEDY_PROMPTS:
            prompts.append(prompt)
            params.append(SamplingParams(temperature=0, max_tokens=48, **{kind: value}))
            cases.append((prompt, kind, value))
        prompts.append([9, 8, 7])
        params.append(SamplingParams(temperature=0.9, max_tokens=30))  # a free request in the same batches
        cases.append(None)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for out, case in zip(outs, cases):
        if case is not None:
            assert out.token_ids == expected_greedy(reference, *case)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_preempted_and_prefix_cached_constrained_sequences_resume_with_identical_tokens(qwen3_checkpoint, reference,
                                                                                       async_scheduling):
    tight = LLM(str(qwen3_checkpoint), device="cpu", kvcache_block_size=4, num_kvcache_blocks=40, max_model_len=64,
                async_scheduling=async_scheduling)
    shared = [100, 200, 300, 400, 5, 6, 7, 8, 9, 10, 11, 12]  # the prefix cache serves its blocks to the others
    prompts = [shared + [i] for i in range(8)]
    kind, value = GREEDY_CASES[0]
    outs = tight.generate(prompts, SamplingParams(temperature=0, max_tokens=48, json_schema=value), use_tqdm=False)
    assert tight.scheduler.num_preemptions > 0 and tight.block_manager.num_cache_hits > 0
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == expected_greedy(reference, prompt, kind, value)
    assert tight.block_manager.num_free_blocks == tight.block_manager.num_blocks


def test_the_device_mask_is_llguidances_bitmask_bit_for_bit():
    from engine.sampling import grammar_mask

    rng = np.random.default_rng(0)
    bitmask = rng.integers(-2**31, 2**31, size=(3, 16), dtype=np.int64).astype(np.int32)
    logits = rng.standard_normal((5, 500)).astype(np.float32)
    expected = logits.copy()
    for r, row in enumerate([1, 2, 4]):
        view = expected[row:row + 1]
        llguidance.numpy.apply_token_bitmask_inplace(view, bitmask[r:r + 1])
    got = torch.from_numpy(logits.copy())
    rows = grammar_mask.GrammarRows([1, 2, 4], torch.tensor([1, 2, 4]), torch.from_numpy(bitmask))
    grammar_mask.apply(got, rows)
    assert torch.equal(got, torch.from_numpy(expected))


@pytest.fixture(scope="module")
def tiny():
    return LLM(TINY_MODEL_DIR, load_format="dummy", device="cpu", max_num_seqs=16)


def test_each_of_n_completions_follows_the_grammar_on_its_own(tiny):
    out = tiny.generate(["Pick"], SamplingParams(n=8, seed=3, max_tokens=MAX_TOKENS, regex=REGEXES[0]),
                        use_tqdm=False)[0]
    assert len(out.outputs) == 8 and len({c.text for c in out.outputs}) > 4
    for c in out.outputs:
        check_completion(tiny, {"regex": REGEXES[0]}, c)
    best = tiny.generate(["Pick"], SamplingParams(n=2, best_of=4, seed=3, max_tokens=MAX_TOKENS,
                                                  json_schema=SCHEMAS["enums"]), use_tqdm=False)[0]
    for c in best.outputs:
        check_completion(tiny, {"json_schema": SCHEMAS["enums"]}, c)


def test_a_stop_string_cuts_a_constrained_completion(tiny):
    choice = ["alpha. beta", "gamma. delta"]
    outs = tiny.generate(["Say"] * 6, SamplingParams(seed=1, max_tokens=20, choice=choice, stop=". "), use_tqdm=False)
    assert {o.text for o in outs} <= {"alpha", "gamma"} and all(o.finish_reason == "stop" for o in outs)


def test_the_grammar_ends_the_completion_whatever_ignore_eos_says(tiny):
    outs = tiny.generate(["Pick"] * 4, SamplingParams(seed=2, max_tokens=MAX_TOKENS, ignore_eos=True,
                                                      choice=CHOICES[0]), use_tqdm=False)
    assert all(o.finish_reason == "stop" and o.text in CHOICES[0] for o in outs)


def test_a_batch_without_constraints_never_touches_the_grammar_path(tiny, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a free batch filled grammar masks")

    monkeypatch.setattr(tiny.masks, "start", refuse)
    outs = tiny.generate(["a", "b"], SamplingParams(max_tokens=8, temperature=0.8), use_tqdm=False)
    assert all(len(o.token_ids) == 8 for o in outs)


def test_grammars_are_compiled_once_per_constraint_and_the_cache_is_bounded(tiny):
    before = len(tiny.grammars)
    for _ in range(3):
        tiny.add_request("x", SamplingParams(max_tokens=4, regex="[a-c]{2}"))
    assert len(tiny.grammars) == before + 1
    for i in range(MAX_CACHED_GRAMMARS + 5):
        tiny.compile_grammar(SamplingParams(regex=f"x{i}"))
    assert len(tiny.grammars) == MAX_CACHED_GRAMMARS
    while tiny.has_unfinished():
        tiny.step()


@pytest.mark.parametrize("kwargs, message", [
    (dict(json_schema={"type": "wat"}), "json_schema must be a JSON schema .*cannot be enforced: .*wat"),
    (dict(json_schema="{not json"), "json_schema must be a JSON schema .*not JSON"),
    (dict(json_schema=["a"]), "json_schema must be a JSON schema"),
    (dict(regex="a(b"), r"regex must be a regular expression .*unclosed group"),
    (dict(regex="(?=a)b"), r"regex must be .*look-around"),
    (dict(choice=[]), "choice must be a non-empty list"),
    (dict(choice=["a", ""]), "choice must be a non-empty list"),
    (dict(choice="yes"), "choice must be a non-empty list"),
    (dict(regex="a", choice=["a"]), "give at most one of json_schema, regex, choice"),
    (dict(json_schema={"type": "object"}, min_tokens=3), "min_tokens must be 0 with json_schema"),
])
def test_bad_constraints_are_one_line_errors_at_add_request(tiny, kwargs, message):
    for params in (kwargs, ):
        with pytest.raises(ValueError, match=message) as e:
            tiny.add_request("x", params)
        assert "\n" not in str(e.value) and len(str(e.value)) < 400
    assert not tiny.has_unfinished()


def test_a_model_without_a_tokenizer_refuses_constraints_at_add_request(tmp_path):
    from tests.conftest import make_checkpoint

    llm = LLM(str(make_checkpoint("qwen3", tmp_path, tokenizer=False)), device="cpu")
    with pytest.raises(ValueError, match="json_schema cannot be enforced: this model has no tokenizer files"):
        llm.add_request([5, 6], SamplingParams(json_schema={"type": "object"}))
    assert not llm.has_unfinished()


def test_mask_kernel_equals_the_torch_mask_under_interpreter():
    """engine/kernels/token_mask.py, the GPU's mask, leaves exactly the logits the torch mask leaves (bf16 and
    fp32, words with bit 31 set, a row allowing one token, a row allowing none, vocabularies off the block)."""
    pytest.importorskip("triton")
    from tests.interpreter import REPO, run_under_interpreter
    cases = run_under_interpreter(REPO / "tests" / "token_mask_cases.py")
    assert set(cases) == {"vocab_37", "vocab_2085", "vocab_64"}
    assert all(n == 0 for case in cases.values() for n in case.values()), cases


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_mask_kernel_equals_the_torch_mask_on_gpu():
    from tests.token_mask_cases import mask_case
    for vocab in (37, 2085, 151936):
        assert mask_case("cuda", vocab) == {"torch.bfloat16": 0, "torch.float32": 0}


def test_a_constraints_sequences_copy_from_several_start_matchers(tiny):
    """Copies of one start matcher compute their masks one at a time (they share a lock), so the sequences
    of one constraint are spread over start matchers built apart, one compiled constraint for all."""
    from engine.sampling.grammar import mask_threads

    compiled = tiny.grammars.compile("regex", "[a-c]{2}")
    states = [compiled.state() for _ in range(6)]
    for state in states:
        state.follow([])
    assert len({state.template for state in states}) == min(6, 2 * mask_threads())
    assert len({id(state.matcher) for state in states}) == 6
    assert tiny.grammars.compile("regex", "[a-c]{2}") is compiled


def test_masks_have_begun_when_start_returns_and_equal_each_matchers_own(tiny):
    """The mask computation runs on a thread of ours, which needs the GIL to begin it: start() hands it over
    and returns once the computation has begun, not when the engine's thread next blocks."""
    from engine.sampling.grammar import MaskFiller

    compiled = tiny.grammars.compile("regex", "[a-c]{2}x|y+")
    states = [compiled.state() for _ in range(5)]
    for state, tokens in zip(states, ([], *tiny.tokenizer(["a", "b", "y", "ab"], add_special_tokens=False)["input_ids"])):
        state.follow(tokens)
    words = (tiny.vocab_size + 31) // 32
    masks = torch.zeros((len(states), words), dtype=torch.int32)
    filler = MaskFiller()
    for _ in range(3):
        future = filler.start([(s, i) for i, s in enumerate(states)], masks.data_ptr(), words * 4, len(states))
        assert future.running() or future.done()
        future.result()
    for row, state in enumerate(states):
        assert masks[row].numpy().tobytes() == state.matcher.compute_bitmask()[: words * 4]


ASCII_CASES = [({"regex": r"\d{4}-\d{2}-\d{2}"}, r"[0-9]{4}-[0-9]{2}-[0-9]{2}"),
               ({"regex": r"\w{3}\s\w{3}"}, r"[0-9A-Za-z_]{3}[\t\n\v\f\r ][0-9A-Za-z_]{3}"),
               ({"json_schema": {"type": "string", "pattern": r"^\d{2}\s\w{2}$"}},
                r"[0-9]{2}[\t\n\v\f\r ][0-9A-Za-z_]{2}")]


@pytest.mark.parametrize("constraint, ascii_match", ASCII_CASES, ids=["date", "words", "schema"])
def test_digit_word_and_space_classes_generate_ascii_only(tiny, constraint, ascii_match):
    """Rust's \\d \\w \\s are Unicode classes ('۴᱁9൪' for \\d{4}); a constraint's are ASCII, as users mean them."""
    params = [SamplingParams(temperature=1.0, seed=seed, max_tokens=40, **constraint) for seed in range(48)]
    outs = tiny.generate(["Write it:"] * len(params), params, use_tqdm=False)
    texts = [o.text for o in outs if o.finish_reason == "stop"]
    assert len(texts) >= 40
    for text in texts:
        value = json.loads(text) if "json_schema" in constraint else text
        assert value.isascii() and re.fullmatch(ascii_match, value), text


# constraints llguidance compiles but cannot follow once text begins: each failed its job at the worker
UNFOLLOWABLE = [
    ("regex", "a{1000000}", "got one that cannot be enforced: it is too large to enforce (lexer error: too many "
                            "expressions constructed)"),
    ("json_schema", {"$ref": "#"}, "got one that cannot be enforced: recursive $ref with no end"),
    ("json_schema", {"type": "object", "required": ["next"], "properties": {"next": {"$ref": "#"}}},
     "got one that cannot be enforced: recursive $ref with no end"),
]


@pytest.mark.parametrize("kind, value, message", UNFOLLOWABLE, ids=["huge-count", "self", "endless"])
def test_constraints_the_engine_cannot_follow_are_refused_by_sampling_params(kind, value, message):
    with pytest.raises(ValueError) as e:
        SamplingParams(**{kind: value})
    assert message in str(e.value) and "\n" not in str(e.value) and len(str(e.value)) < 400


def test_a_recursive_schema_with_an_end_is_accepted_and_followed(tiny):
    tree = {"type": "object", "additionalProperties": False, "required": ["v"],
            "properties": {"v": {"type": "integer", "minimum": 0, "maximum": 9}, "next": {"$ref": "#"}}}
    outs = tiny.generate(["Tree:"] * 8, [SamplingParams(seed=i, max_tokens=MAX_TOKENS, json_schema=tree)
                                         for i in range(8)], use_tqdm=False)
    for out in outs:
        check_completion(tiny, {"json_schema": tree}, out.outputs[0])


def test_a_check_past_its_budget_is_a_one_line_error(monkeypatch):
    from engine.sampling import grammar

    monkeypatch.setattr(grammar, "COMPILE_BUDGET_S", 0.01)  # a{999999} takes a few tenths of a second
    try:
        error = grammar.check("regex", "a{999999}")
    finally:
        grammar._checked.cache_clear()
    assert error == "it took longer than 0.01 s to check; simplify it"


def gated(cache, kind: str, value):
    """`cache` with its compile of one constraint held until the returned gate opens (and `began` set
    once it waits): a compile as slow as the test needs, the real one after it."""
    began, gate, build, slow = threading.Event(), threading.Event(), cache._build, grammar_of(kind, value)

    def build_after_gate(grammar):
        if grammar == slow:
            began.set()
            gate.wait(60)
        return build(grammar)
    cache._build = build_after_gate
    return began, gate


def test_a_compile_past_its_budget_fails_its_constraint_and_its_late_result_is_dropped(tiny):
    from engine.sampling.grammar import GrammarCache

    cache = GrammarCache(tiny.tokenizer, tiny.vocab_size, tiny.config.eos_token_id, budget_s=0.3)
    began, gate = gated(cache, "regex", "[a-c]{5}")
    with pytest.raises(ValueError, match=r"^the regex took longer than 0.3 s to compile; simplify it$"):
        cache.compile("regex", "[a-c]{5}")
    assert began.is_set()
    assert cache.compile("regex", "x|y") is not None  # other constraints compile meanwhile
    gate.set()
    for _ in range(2):  # the same constraint again, after its compile ended late: the same error, at once
        with pytest.raises(ValueError, match="took longer than 0.3 s"):
            cache.compile("regex", "[a-c]{5}")
