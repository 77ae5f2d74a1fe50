"""`redline batch`: OpenAI Batch API files through the real queue, worker and engine."""
import json

import pytest

from engine import LLM, SamplingParams
from engine.builtin import TINY_MODEL_DIR
from worker.cli import main

IDS = [11, 12, 13, 14, 15]
# body fields at the value that changes nothing, and at one that redline does not honour yet
NOOPS = dict(n=1, presence_penalty=0, frequency_penalty=0.0, logprobs=False, top_logprobs=None, stream=False,
             response_format={"type": "text"}, model="m", user="u", metadata={"k": "v"}, store=False,
             service_tier="auto", parallel_tool_calls=True)
NOT_HONOURED = {"tools": [{"type": "function", "function": {"name": "f"}}], "stream": True}
ITEM = {"type": "object", "additionalProperties": False, "required": ["sku", "qty"], "properties": {
    "sku": {"type": "string", "pattern": "^[A-Z]{3}[0-9]{2}$"}, "qty": {"type": "integer", "minimum": 1, "maximum": 9}}}
RESPONSE_FORMATS = {  # custom_id -> (url, response_format)
    "json-object": ("/v1/chat/completions", {"type": "json_object"}),
    "json-schema": ("/v1/completions", {"type": "json_schema", "json_schema": {"name": "item", "schema": ITEM,
                                                                              "strict": True}}),
    "schema-bad": ("/v1/completions", {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "wat"}}}),
    "format-bad": ("/v1/completions", {"type": "xml"}),
}
CHAT_BREADTH = dict(n=2, presence_penalty=0.5, frequency_penalty=0.4, logit_bias={"17": 3, "40": -100}, seed=7,
                    logprobs=True, top_logprobs=2, max_completion_tokens=5, temperature=0.9)


def request(custom_id, url, **body):
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


@pytest.fixture(scope="module")
def ran(tmp_path_factory):
    d = tmp_path_factory.mktemp("batch")
    lines = [
        request("chat", "/v1/chat/completions", model="x", messages=[{"role": "user", "content": "Hi"}],
                max_tokens=6, temperature=0, ignore_eos=True),
        "this is not json",
        request("ids", "/v1/completions", prompt=IDS, max_completion_tokens=7, temperature=0, ignore_eos=True),
        request("bad-url", "/v1/moderations", input="x"),
        request("two", "/v1/completions", prompt="a", n=2, max_tokens=8),
        request("unknown", "/v1/completions", prompt="a", frobnicate=3),
        request("negative", "/v1/completions", prompt="a", max_tokens=-4),
        request("text", "/v1/completions", prompt="The queue holds", max_tokens=5, temperature=0.8, seed=3),
        request("noop", "/v1/chat/completions", messages=[{"role": "user", "content": "Hi"}], max_tokens=3, **NOOPS),
        *[request(name, "/v1/chat/completions", messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
                  **{name: value}) for name, value in NOT_HONOURED.items()],
        request("chat-n", "/v1/chat/completions", messages=[{"role": "user", "content": "Hi"}], **CHAT_BREADTH),
        request("text-n", "/v1/completions", prompt=IDS, n=3, best_of=4, logprobs=2, max_tokens=4, seed=1),
        *[request(name, url, response_format=fmt, max_tokens=400, seed=2, n=2,
                  **({"messages": [{"role": "user", "content": "JSON please"}]} if "chat" in url else {"prompt": "Item:"}))
          for name, (url, fmt) in RESPONSE_FORMATS.items()],
        request("top-without-logprobs", "/v1/chat/completions", messages=[{"role": "user", "content": "Hi"}],
                top_logprobs=2),
        request("echo", "/v1/completions", prompt=IDS, echo=True, logprobs=1, max_tokens=2, temperature=0,
                ignore_eos=True),
        request("chat-echo", "/v1/chat/completions", messages=[{"role": "user", "content": "Hi"}], echo=True),
        request("echo-zero", "/v1/completions", prompt=IDS, echo=True, logprobs=1, max_tokens=0),
        request("one-listed", "/v1/completions", prompt=[IDS], max_completion_tokens=7, temperature=0, ignore_eos=True),
        request("two-prompts", "/v1/completions", prompt=[IDS, "a"], max_tokens=2),
    ]
    (d / "in.jsonl").write_text("\n".join(lines) + "\n")
    rc = main(["batch", str(d / "in.jsonl"), "-o", str(d / "out.jsonl"), "--device", "cpu"])
    return rc, [json.loads(x) for x in (d / "out.jsonl").read_text().splitlines()]


def test_one_output_line_per_input_line_in_order(ran):
    rc, out = ran
    assert rc == 0
    assert [o["custom_id"] for o in out] == ["chat", None, "ids", "bad-url", "two", "unknown", "negative", "text",
                                             "noop", *NOT_HONOURED, "chat-n", "text-n", *RESPONSE_FORMATS,
                                             "top-without-logprobs", "echo", "chat-echo", "echo-zero",
                                             "one-listed", "two-prompts"]
    assert len({o["id"] for o in out}) == len(out)


def test_good_requests_get_completions_with_usage(ran):
    _, out = ran
    chat, ids, text = out[0], out[2], out[7]
    for o in (chat, ids, text):
        assert o["error"] is None and o["response"]["status_code"] == 200
    assert chat["response"]["body"]["object"] == "chat.completion"
    assert chat["response"]["body"]["choices"][0]["message"]["role"] == "assistant"
    assert chat["response"]["body"]["usage"]["completion_tokens"] == 6
    assert ids["response"]["body"]["object"] == "text_completion"
    assert ids["response"]["body"]["usage"] == {"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12}
    assert 1 <= text["response"]["body"]["usage"]["completion_tokens"] <= 5


def test_completion_equals_the_engine_alone(ran):
    _, out = ran
    expected = LLM(TINY_MODEL_DIR, load_format="dummy", device="cpu").generate(
        [IDS], SamplingParams(temperature=0, max_tokens=7, ignore_eos=True), use_tqdm=False)[0]
    for line in (out[2], out[-2]):  # "ids", and "one-listed": the same prompt as a list of one
        choice = line["response"]["body"]["choices"][0]
        assert choice["text"] == expected.text and choice["finish_reason"] == "length"


@pytest.mark.parametrize("index, message", [
    (1, "not JSON"), (3, "url must be one of"), (5, "unsupported body fields: frobnicate"), (6, "max_tokens"),
    (-6, "top_logprobs needs logprobs=true"), (-3, "echo with max_tokens 0 (the prompt alone) is answered online"),
    (-1, "prompt holds 2 prompts; a batch line takes one: give each a line of its own"),
])
def test_bad_lines_become_error_lines(ran, index, message):
    _, out = ran
    assert out[index]["response"] is None
    assert message in out[index]["error"]["message"]


def test_field_at_its_no_op_value_runs(ran):
    _, out = ran
    noop = out[8]
    assert noop["error"] is None and noop["response"]["body"]["usage"]["completion_tokens"] >= 1


@pytest.mark.parametrize("name", NOT_HONOURED)
def test_unhonoured_field_is_an_error_on_its_line_naming_it(ran, name):
    _, out = ran
    line = out[9 + list(NOT_HONOURED).index(name)]
    assert line["custom_id"] == name and line["response"] is None
    assert line["error"]["message"].startswith(f"{name}=")
    assert "not supported yet" in line["error"]["message"]


def test_n_penalties_bias_and_logprobs_give_openai_shaped_chat_choices(ran):
    _, out = ran
    body = out[9 + len(NOT_HONOURED)]["response"]["body"]
    choices = body["choices"]
    assert [c["index"] for c in choices] == [0, 1]
    assert body["usage"]["completion_tokens"] == sum(len(c["logprobs"]["content"]) for c in choices)
    for c in choices:
        assert c["message"]["role"] == "assistant" and isinstance(c["message"]["content"], str)
        assert c["finish_reason"] in ("stop", "length") and set(c) == {"index", "message", "logprobs", "finish_reason"}
        content = c["logprobs"]["content"]
        assert 1 <= len(content) <= 5
        for token in content:
            assert set(token) == {"token", "logprob", "bytes", "top_logprobs"} and token["logprob"] <= 0
            assert token["bytes"] == list(token["token"].encode("utf-8")) and len(token["top_logprobs"]) == 2
            assert set(token["top_logprobs"][0]) == {"token", "logprob", "bytes"}
    expected = LLM(TINY_MODEL_DIR, load_format="dummy", device="cpu").chat(
        [{"role": "user", "content": "Hi"}],
        SamplingParams(n=2, presence_penalty=0.5, frequency_penalty=0.4, logit_bias={17: 3, 40: -100}, seed=7,
                       logprobs=2, max_tokens=5, temperature=0.9), use_tqdm=False)[0]
    assert [c["message"]["content"] for c in choices] == [c.text for c in expected.outputs]


def test_n_best_of_and_logprobs_give_openai_shaped_completion_choices(ran):
    _, out = ran
    body = out[10 + len(NOT_HONOURED)]["response"]["body"]
    assert body["object"] == "text_completion" and [c["index"] for c in body["choices"]] == [0, 1, 2]
    for c in body["choices"]:
        lp = c["logprobs"]
        assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"])
        assert all(len(top) <= 2 for top in lp["top_logprobs"]) and lp["text_offset"][0] == 0
    assert body["usage"]["completion_tokens"] == sum(len(c["logprobs"]["tokens"]) for c in body["choices"])
    best = [sum(c["logprobs"]["token_logprobs"]) for c in body["choices"]]
    assert best == sorted(best, reverse=True)  # best_of: the n best by cumulative logprob, best first
    two = out[4]["response"]["body"]
    assert [c["index"] for c in two["choices"]] == [0, 1] and all(c["logprobs"] is None for c in two["choices"])


def test_response_format_constrains_every_choice(ran):
    import jsonschema

    _, out = ran
    by_id = {o["custom_id"]: o for o in out}
    anything = by_id["json-object"]["response"]["body"]["choices"]
    items = by_id["json-schema"]["response"]["body"]["choices"]
    assert len(anything) == len(items) == 2
    for c in anything:
        if c["finish_reason"] == "stop":  # any object: nested and unbounded, so it may also run out of tokens
            assert isinstance(json.loads(c["message"]["content"]), dict)
        else:
            assert c["finish_reason"] == "length" and c["message"]["content"].startswith("{")
    for c in items:
        assert c["finish_reason"] == "stop"
        jsonschema.validate(json.loads(c["text"]), ITEM)


@pytest.mark.parametrize("custom_id, message", [
    ("schema-bad", "sampling.json_schema must be a JSON schema"), ("format-bad", "response_format must be"),
])
def test_a_bad_response_format_is_an_error_on_its_line(ran, custom_id, message):
    _, out = ran
    line = next(o for o in out if o["custom_id"] == custom_id)
    assert line["response"] is None and message in line["error"]["message"]


@pytest.mark.parametrize("case, message", [
    ("missing", "cannot read"), ("empty", "is empty"), ("not-jsonl", "is not JSONL"), ("binary", "not UTF-8"),
    ("output-is-dir", "is a directory"), ("detach-without-redis", "--detach needs a queue"),
])
def test_user_mistake_is_one_line_without_traceback(tmp_path, capsys, case, message):
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text(request("a", "/v1/completions", prompt="x") + "\n")
    extra = []
    if case == "empty":
        src.write_text("\n")
    elif case == "not-jsonl":
        src.write_text(json.dumps([{"custom_id": "a"}], indent=2))
    elif case == "binary":
        src.write_bytes(b"\xff\xfe\x00\x01" * 8)
    elif case == "output-is-dir":
        out.mkdir()
    elif case == "detach-without-redis":
        extra = ["--detach"]
    argv = ["batch", str(tmp_path / "missing.jsonl" if case == "missing" else src), "-o", str(out), *extra]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_a_completion_with_echo_starts_with_its_scored_prompt(ran):
    _, out = ran
    lines = {o["custom_id"]: o for o in out}
    echo, chat_echo = lines["echo"], lines["chat-echo"]
    choice = echo["response"]["body"]["choices"][0]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(IDS) + 2 and choice["text"] == "".join(lp["tokens"])
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(isinstance(v, float) for v in lp["token_logprobs"][1:])
    assert all(len(top) == 1 for top in lp["top_logprobs"][1:])
    assert chat_echo["response"] is None and "echo is a completions field" in chat_echo["error"]["message"]
