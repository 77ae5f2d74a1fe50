import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from engine.builtin import TINY_MODEL_DIR


@pytest.fixture(scope="module")
def llm():
    return LLM(TINY_MODEL_DIR, load_format="dummy", device="cpu", max_model_len=64)


GOOD = SamplingParams(temperature=0, max_tokens=4)


@pytest.mark.parametrize("prompt, message", [
    ([1] * 64, "prompt has 64 tokens; max_model_len is 64"),
    ([], "prompt is empty"),
    ("", "prompt is empty"),
    ([1, 2, 512], "token id 512 at position 2 is outside the vocabulary"),
    ([1, -1], "token id -1"),
    ([1, "a"], "string or a list of int token ids"),
    (None, "string or a list of int token ids"),
])
def test_bad_prompt_is_rejected_and_engine_stays_usable(llm, prompt, message):
    with pytest.raises(ValueError, match=message):
        llm.generate([[5, 6, 7], prompt], GOOD, use_tqdm=False)
    assert not llm.has_unfinished()
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks
    out = llm.generate([[5, 6, 7]], GOOD, use_tqdm=False)[0]
    assert len(out.token_ids) == 4


def test_duplicate_request_id_is_rejected(llm):
    llm.add_request([1, 2], GOOD, request_id="same")
    with pytest.raises(ValueError, match="already in the engine"):
        llm.add_request([1, 2], GOOD, request_id="same")
    while llm.has_unfinished():
        llm.step()


def test_unknown_model_path_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="not a directory with a config.json"):
        LLM(str(tmp_path / "nowhere"), device="cpu")
    with pytest.raises(ValueError, match="has no config.json"):
        LLM(str(tmp_path), device="cpu")


def test_unsupported_architecture_names_the_supported_ones(tmp_path):
    (tmp_path / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}')
    with pytest.raises(ValueError, match="supported: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, "
                                         "Qwen3ForCausalLM, Gemma2ForCausalLM, Gemma3ForCausalLM, Phi3ForCausalLM"):
        LLM(str(tmp_path), device="cpu")


def test_missing_weights_say_how_to_get_random_ones(tmp_path):
    import shutil
    shutil.copytree(TINY_MODEL_DIR, tmp_path / "m")
    with pytest.raises(ValueError, match="load_format='dummy'"):
        LLM(str(tmp_path / "m"), device="cpu")


def test_text_prompt_without_tokenizer_is_a_clear_error(tmp_path):
    import shutil
    (tmp_path / "m").mkdir()
    shutil.copy(f"{TINY_MODEL_DIR}/config.json", tmp_path / "m")
    llm = LLM(str(tmp_path / "m"), load_format="dummy", device="cpu")
    with pytest.raises(ValueError, match="no tokenizer"):
        llm.generate(["hello"], GOOD, use_tqdm=False)
    out = llm.generate([[3, 4, 5]], GOOD, use_tqdm=False)[0]
    assert len(out.token_ids) == 4 and out.text is None


@pytest.mark.parametrize("kwargs, message", [
    ({"load_format": "pickle"}, "load_format"), ({"dtype": "int3"}, "dtype"),
    ({"max_num_seqs": 0}, "max_num_seqs"), ({"attention_backend": "magic"}, "attention_backend"),
    ({"max_model_len": 10**6}, "max_position_embeddings"), ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
    ({"tensor_parallel_size": 3}, "divisible by tensor_parallel_size"),
    ({"kv_cache_dtype": "int4"}, "kv_cache_dtype must be one of auto, fp8, fp8_e4m3"),
    ({"kv_cache_dtype": "fp8", "attention_backend": "flash"}, "not supported by attention_backend='flash'"),
])
def test_bad_engine_options_are_clear_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LLM(TINY_MODEL_DIR, **{"load_format": "dummy", "device": "cpu", **kwargs})


class _FailingTokenizer:
    """The engine's tokenizer, except that decoding a given token raises: an error that belongs to the one
    request whose stop strings make the engine decode it (no valid request reaches this any other way)."""

    def __init__(self, tokenizer, bad_token: int) -> None:
        self._tokenizer, self._bad = tokenizer, bad_token

    def decode(self, ids, **kwargs):
        if self._bad in ids:
            raise RuntimeError("cannot decode")
        return self._tokenizer.decode(ids, **kwargs)

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)


def test_an_error_of_one_request_during_a_step_fails_it_alone(llm):
    greedy = SamplingParams(temperature=0, max_tokens=6)
    expected = llm.generate([[5, 6, 7], [8, 9]], greedy, use_tqdm=False)
    bad_token = expected[0].token_ids[2]
    real = llm.tokenizer
    llm.tokenizer = _FailingTokenizer(real, bad_token)
    try:  # the first request checks stop strings (so decodes its tokens); the second does not
        outs = llm.generate([[5, 6, 7], [8, 9]], [SamplingParams(temperature=0, max_tokens=6, stop=["zzz"]), greedy],
                            use_tqdm=False)
    finally:
        llm.tokenizer = real
    failed, other = outs
    assert failed.finish_reason == "abort" and "RuntimeError: cannot decode" in failed.error
    assert bad_token in failed.token_ids and failed.token_ids == expected[0].token_ids[:len(failed.token_ids)]
    assert other.error is None and other.token_ids == expected[1].token_ids
    assert not llm.has_unfinished()
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="the flash backend needs triton")
def test_a_flash_attn_that_does_not_load_is_named_with_its_error(tmp_path):
    """A flash_attn build that does not match the installed torch (the commonest failure) is reported with the
    error its import raised, not as a missing package."""
    broken = tmp_path / "flash_attn"
    broken.mkdir()
    (broken / "__init__.py").write_text("raise ImportError('flash_attn_2_cuda: undefined symbol: _ZN3c104SetDevice')\n")
    probe = "from engine.attention import flash_missing; print(flash_missing())"
    run = lambda path: subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120,
                                      env={**os.environ, "PYTHONPATH": os.pathsep.join(path)}).stdout.strip()
    repo = str(Path(__file__).resolve().parents[1])
    assert run([repo, str(tmp_path)]).startswith("cannot load the installed flash_attn: ")
    assert "undefined symbol: _ZN3c104SetDevice" in run([repo, str(tmp_path)])
    if importlib.util.find_spec("flash_attn") is None:
        assert run([repo]) == "needs the flash_attn package (pip install 'redline[flash]')"
