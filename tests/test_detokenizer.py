"""The engine's one incremental detokenizer: its pieces concatenate to the text one decode of the whole
completion gives, stop strings are found across token boundaries and never sent past, and a step's cost
does not grow with the completion's length. The tiny model's real tokenizer (byte-level BPE, in which a
character of several bytes spans several tokens)."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine import LLM, SamplingParams
from engine.builtin import TINY_MODEL_DIR
from engine.inputs.detokenizer import Detokenizer
from engine.inputs.tokenizer import load_tokenizer

TOKENIZER = load_tokenizer(TINY_MODEL_DIR)
MULTIBYTE = "héllo wörld 世界 🙂🚀 ünïcödé ok"


def decoded(ids: list[int]) -> str:
    return TOKENIZER.decode(ids, skip_special_tokens=True)


def feed(ids: list[int], chunks: list[int], stop=(), end: int | None = None) -> tuple[Detokenizer, list[str]]:
    """Feed `ids` a chunk at a time (sizes from `chunks`, cycled), then finish with ids[:end]; the pieces
    take() handed out after each."""
    detok, pieces, fed, i = Detokenizer(TOKENIZER, stop), [], 0, 0
    while fed < len(ids) and not detok.stopped:
        fed = min(fed + chunks[i % len(chunks)], len(ids))
        i += 1
        detok.update(ids, fed, find_stop=True)
        pieces.append(detok.take())
    detok.finish(ids, len(ids) if end is None else end)
    pieces.append(detok.take())
    return detok, pieces


token_ids = st.lists(st.integers(0, len(TOKENIZER) - 1), max_size=60)
multibyte_ids = st.lists(st.sampled_from(TOKENIZER.encode(MULTIBYTE)), max_size=60)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ids=st.one_of(token_ids, multibyte_ids, st.just(TOKENIZER.encode(MULTIBYTE))),
       chunks=st.lists(st.integers(1, 4), min_size=1, max_size=5))
def test_pieces_concatenate_to_the_decode_of_the_whole_completion(ids, chunks):
    detok, pieces = feed(ids, chunks)
    assert "".join(pieces) == detok.text == decoded(ids)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=st.text(st.sampled_from(list("ab éü世🙂")), max_size=30),
       stop=st.sampled_from(["é", "b 世", "🙂a", "aa"]), chunks=st.lists(st.integers(1, 3), min_size=1, max_size=4))
def test_a_stop_string_across_tokens_cuts_the_text_and_no_piece_passes_it(text, stop, chunks):
    ids = TOKENIZER.encode(text)
    detok, pieces = feed(ids, chunks, stop=[stop])
    whole = decoded(ids)
    assert detok.stopped == (stop in whole)
    assert "".join(pieces) == detok.text == (whole[: whole.find(stop)] if stop in whole else whole)


def test_the_stop_is_found_at_the_token_that_completes_it():
    ids = TOKENIZER.encode("one two 世界 three")
    detok = Detokenizer(TOKENIZER, ["o 世"])
    found_at = next(n for n in range(1, len(ids) + 1) if detok.update(ids, n, find_stop=True))
    assert decoded(ids[:found_at]).endswith("o 世") and "o 世" not in decoded(ids[: found_at - 1])
    assert detok.text == "one tw"


def test_text_before_min_tokens_is_searched_once_the_check_starts_and_never_sent_past_the_stop():
    ids = TOKENIZER.encode("an END then more words")
    detok, pieces = Detokenizer(TOKENIZER, ["END"]), []
    for n in range(1, len(ids) + 1):
        if detok.update(ids, n, find_stop=n >= len(ids) - 2):  # min_tokens: the check starts near the end
            break
        pieces.append(detok.take())
    detok.finish(ids, n)
    pieces.append(detok.take())
    assert detok.stopped and "".join(pieces) == detok.text == "an "


def test_a_step_costs_the_same_at_the_end_of_a_long_completion_as_at_its_start():
    ids = TOKENIZER.encode("the quick brown fox jumps over the lazy dog; " * 40)
    detok, costs = Detokenizer(TOKENIZER, ["never here", "nor this"]), []
    for n in range(1, len(ids) + 1):
        tokens, chars = detok.num_decoded_tokens, detok.num_searched_chars
        assert not detok.update(ids, n, find_stop=True)
        costs.append((detok.num_decoded_tokens - tokens, detok.num_searched_chars - chars))
    assert len(ids) > 500
    # each step decodes a window of a few tokens and searches its new text and a tail of
    # len("never here") - 1 characters, however long the completion is
    assert max(t for t, _ in costs) <= 8 and max(c for _, c in costs) <= 9 + 16
    assert max(costs[-100:]) <= max(costs[:100])


@pytest.fixture(scope="module")
def llm():
    return LLM(TINY_MODEL_DIR, load_format="dummy", device="cpu", kvcache_block_size=8)


def stream_texts(llm, rid: str) -> tuple[dict[int, str], dict[int, int], object]:
    """Step until request `rid` finishes: each completion's new_text joined, how many steps gave it some
    text, and the final output."""
    texts, steps_with_text = {}, {}
    while True:
        for out in llm.step().outputs:
            if out.request_id != rid:
                continue
            for c in out.outputs:
                texts[c.index] = texts.get(c.index, "") + c.new_text
                steps_with_text[c.index] = steps_with_text.get(c.index, 0) + bool(c.new_text)
            if out.finished:
                return texts, steps_with_text, out


def test_a_streamed_request_s_completions_carry_their_text_as_it_comes(llm):
    params = SamplingParams(n=3, temperature=0.9, seed=3, max_tokens=40, ignore_eos=True)
    [expected] = llm.generate([MULTIBYTE], params, use_tqdm=False)
    rid = llm.add_request(MULTIBYTE, params, stream=True)
    texts, steps_with_text, out = stream_texts(llm, rid)
    assert [c.text for c in out.outputs] == [c.text for c in expected.outputs]
    assert texts == {c.index: c.text for c in out.outputs}
    assert all(steps_with_text[i] > 5 for i in range(3))  # live, not once at the end
    assert out.new_text == out.outputs[0].new_text


def test_stop_strings_cut_each_completion_as_a_whole_decode_would(llm):
    base = SamplingParams(n=2, temperature=0.9, seed=11, max_tokens=40)
    [free] = llm.generate([MULTIBYTE], base, use_tqdm=False)
    stop = free.outputs[1].text[10:13]
    params = SamplingParams(n=2, temperature=0.9, seed=11, max_tokens=40, stop=[stop])
    [cut] = llm.generate([MULTIBYTE], params, use_tqdm=False)
    for c, whole in zip(cut.outputs, free.outputs):
        assert c.text == (whole.text[: whole.text.find(stop)] if stop in whole.text else whole.text)
    assert cut.outputs[1].finish_reason == "stop" and len(cut.outputs[1].token_ids) < len(free.outputs[1].token_ids)
    rid = llm.add_request(MULTIBYTE, params)  # stop strings alone make the text come as it is generated
    texts, _, out = stream_texts(llm, rid)
    assert texts == {c.index: c.text for c in out.outputs} == {c.index: c.text for c in cut.outputs}


def test_best_of_hands_out_its_chosen_completions_whole_at_the_end(llm):
    params = SamplingParams(n=2, best_of=4, temperature=0.9, seed=5, max_tokens=12, stop=["zz"])
    [expected] = llm.generate([MULTIBYTE], params, use_tqdm=False)
    rid = llm.add_request(MULTIBYTE, params, stream=True)
    texts, steps_with_text, out = stream_texts(llm, rid)
    # while it runs it reports its 4 sequences, with no text
    assert texts == {0: expected.outputs[0].text, 1: expected.outputs[1].text, 2: "", 3: ""}
    assert steps_with_text == {0: 1, 1: 1, 2: 0, 3: 0}
    assert [c.new_token_ids for c in out.outputs] == [c.token_ids for c in expected.outputs]


def test_a_request_without_stop_strings_or_a_stream_keeps_no_detokenizer(llm):
    rid = llm.add_request([5, 6, 7], SamplingParams(max_tokens=4))
    assert llm.requests[rid].first.detokenizer is None
    llm.abort(rid)
    while llm.has_unfinished():
        llm.step()
