"""worker/bench_engine.py: the workload is nano-vllm's, the shipped configs load, and run() reports a record."""
from __future__ import annotations

import argparse
import json
import time

import pytest

from engine.builtin import TINY_MODEL_DIR
from worker import bench_engine as bench


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_default_workload_is_nano_vllm_bench():
    prompts, params = bench.make_workload(parse())
    assert len(prompts) == len(params) == 256
    assert sum(sp.max_tokens for sp in params) == 133_966
    assert all(100 <= len(p) <= 1024 and all(0 <= t <= 10000 for t in p) for p in prompts)
    assert all(sp.ignore_eos for sp in params)


def test_shipped_configs_have_qwen3_shapes_and_floor_matches_design():
    from engine.config import load_hf_config

    small = load_hf_config(bench.resolve_model("qwen3-0.6b"))
    large = load_hf_config(bench.resolve_model("qwen3-8b"))
    assert (small.hidden_size, small.num_hidden_layers, small.num_attention_heads) == (1024, 28, 16)
    assert (large.hidden_size, large.num_hidden_layers, large.num_attention_heads) == (4096, 36, 32)
    assert small.tie_word_embeddings and not large.tie_word_embeddings
    assert round(bench.count_parameters(small) / 1e9, 2) == 0.60
    assert round(bench.count_parameters(large) / 1e9, 1) == 8.2
    xl = load_hf_config(bench.resolve_model("qwen3-32b"))  # TP=4 against TP=2 on 4 GPUs
    assert (xl.hidden_size, xl.num_hidden_layers, xl.num_attention_heads, xl.num_key_value_heads) == (5120, 64, 64, 8)
    assert round(bench.count_parameters(xl) / 1e9, 1) == 32.8
    prompts, params = bench.make_workload(parse())
    assert abs(bench.floor_seconds(small, prompts, params, 3.02e12) - 5.0) < 0.05  # DESIGN's H100 floor


def test_run_prints_one_json_record(capsys):
    args = parse("--model", str(TINY_MODEL_DIR), "--num-seqs", "3", "--min-input-len", "5",
                 "--max-input-len", "20", "--min-output-len", "2", "--max-output-len", "6", "--max-token-id", "500",
                 "--device", "cpu", "--max-model-len", "64", "--bandwidth", "1e11")
    record = bench.run(args)
    _, params = bench.make_workload(args)
    assert record["tokens"] == sum(sp.max_tokens for sp in params)
    assert record["seconds"] > 0 and record["ratio_to_floor"] > 0
    last_line = capsys.readouterr().out.strip().splitlines()[-1]
    assert json.loads(last_line) == record


def test_the_record_names_the_commit_given_or_the_checkouts():
    assert bench.git_commit("abc1234") == "abc1234"
    assert parse("--commit", "abc1234").commit == "abc1234"
    assert bench.git_commit(None) == bench.git_commit()


def test_kernels_compiled_during_the_timed_run_are_counted_and_reported(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    assert bench.compiled_kernels() == 0
    since = time.time() - 1
    (tmp_path / "kernel-a").mkdir()
    (tmp_path / "kernel-a" / "_pushed_sum.json").write_text("{}")
    (tmp_path / "kernel-a" / "__grp___pushed_sum.json").write_text("{}")
    (tmp_path / "kernel-b").mkdir()
    assert bench.compiled_kernels() == 2
    assert bench.kernels_compiled_since(since) == ["_pushed_sum"]
    assert bench.kernels_compiled_since(time.time() + 60) == []
    bench.warn_if_compiled(2, ["_pushed_sum"])
    assert "2 Triton kernels were compiled during the timed run" in capsys.readouterr().err


def _bench_profile():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "bench" / "bench_profile.py"
    spec = importlib.util.spec_from_file_location("bench_profile", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bench_profile_traces_the_steps_asked_for_and_refuses_bad_ranges(tmp_path, monkeypatch, capsys):
    import pytest

    bench_profile = _bench_profile()
    assert bench_profile.step_ranges("400-401,0-1") == [(0, 1), (400, 401)]
    for bad in ("5", "3-1", "a-b", "0-2,2-3"):
        with pytest.raises(argparse.ArgumentTypeError):
            bench_profile.step_ranges(bad)
    monkeypatch.setattr("sys.argv", ["bench_profile.py", "--model", str(TINY_MODEL_DIR), "--num-seqs", "3",
                                     "--min-input-len", "5", "--max-input-len", "20", "--min-output-len", "4",
                                     "--max-output-len", "6", "--max-token-id", "500", "--device", "cpu",
                                     "--max-model-len", "64", "--trace", "0-0,2-3", "--out", str(tmp_path)])
    bench_profile.main()
    record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert record["kernels_compiled_in_run"] == 0 and record["traced_seconds"] > 0
    assert sorted(p.name for p in tmp_path.glob("*.json")) == ["trace_tp1_steps0-0.json", "trace_tp1_steps2-3.json"]
    assert json.loads((tmp_path / "trace_tp1_steps2-3.json").read_text())["traceEvents"]


def test_floor_reads_only_the_window_of_sliding_window_layers():
    from engine.config import load_hf_config

    assert bench.attended_positions(10, 5) == 10 + 11 + 12 + 13 + 14
    assert bench.attended_positions(10, 5, window=12) == 10 + 11 + 12 + 12 + 12
    assert bench.attended_positions(30, 3, window=12) == 3 * 12
    gemma = load_hf_config(bench.resolve_model("gemma3-1b"))  # five of every six layers see 512 positions
    prompts, params = bench.make_workload(parse())
    windowed = bench.floor_seconds(gemma, prompts, params, 3.02e12)
    gemma.layer_types = ["full_attention"] * gemma.num_hidden_layers
    assert 0.5 < windowed / bench.floor_seconds(gemma, prompts, params, 3.02e12) < 0.8


def test_json_schema_constrains_every_completion_of_the_workload(tmp_path, capsys):
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["n"], "additionalProperties": False}
    (tmp_path / "schema.json").write_text(json.dumps(schema))
    args = parse("--model", "tiny", "--num-seqs", "4", "--min-input-len", "5", "--max-input-len", "20",
                 "--min-output-len", "30", "--max-output-len", "40", "--max-token-id", "500", "--device", "cpu",
                 "--max-model-len", "64", "--json-schema", str(tmp_path / "schema.json"))
    record = bench.run(args)
    assert record["json_schema"] == str(tmp_path / "schema.json") and record["floor_seconds"] is None
    assert 4 * len('{"n": 0}') // 2 <= record["tokens"] <= 4 * len('{"n": 0}')  # each ends with its JSON
    (tmp_path / "bad.json").write_text('{"type": "wat"}')
    for argv, message in ((["--json-schema", str(tmp_path / "bad.json")], "--json-schema .*json_schema must be"),
                          (["--json-schema", str(tmp_path / "none.json")], "--json-schema: cannot read"),
                          (["--model", "qwen3-0.6b", "--json-schema", str(tmp_path / "schema.json")],
                           "needs a model with a tokenizer")):
        with pytest.raises(ValueError, match=message):
            bench.check_arguments(parse("--device", "cpu", *argv))


def test_breadth_bench_compares_n4_with_separate_requests_and_penalties_with_none(capsys):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "bench" / "breadth.py"
    spec = importlib.util.spec_from_file_location("breadth", path)
    breadth = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(breadth)
    assert breadth.main(["--model", str(TINY_MODEL_DIR), "--device", "cpu", "--num-seqs", "3", "--min-input-len", "5",
                         "--max-input-len", "20", "--min-output-len", "4", "--max-output-len", "6",
                         "--max-model-len", "64"]) == 0
    record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    # the same completions either way: n=4 of 3 prompts is 4x the tokens of the penalised 3
    assert record["n4_tokens"] == record["separate_tokens"] == 4 * record["plain_tokens"] > 0
    assert record["penalties_tokens"] == record["plain_tokens"]
    assert record["n4_vs_separate"] > 0 and record["penalties_vs_plain"] > 0
