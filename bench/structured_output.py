"""Reproduces docs/performance.md's structured-output figure: nano-bench's prompts with every completion
constrained by a JSON schema whose outputs run long (an array of 20 to 300 small objects), against the same
prompts unconstrained with the same output lengths, on one engine, alternating (U C U C) after a first constrained
run (reported apart: the grammar's lexer states are built as masks first need them); and the host time
a step takes on the engine's thread for the grammar (following the sampled tokens, waiting for masks) and the
masks' own time beside it.
    python3 bench/structured_output.py [--workdir DIR] [worker.bench_engine's options]

The shipped shapes have no tokenizer and a mask's cost grows with the vocabulary, so the first run trains a
byte-level BPE tokenizer of Qwen3's vocabulary size on the Python standard library's sources (the
`tokenizers` trainer) and saves it beside the model's config.json under --workdir, where later runs find it.
Prints one JSON line.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import sysconfig
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the tree this script is in

from worker import bench_engine as bench  # noqa: E402

SCHEMA = {
    "type": "array", "minItems": 20, "maxItems": 300,
    "items": {"type": "object", "additionalProperties": False, "required": ["id", "kind", "ok"],
              "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 9999},
                             "kind": {"enum": ["point", "line", "area"]}, "ok": {"type": "boolean"}}},
}
EOS = "<|endoftext|>"


def model_with_tokenizer(model: str, workdir: Path, vocab_size: int) -> Path:
    """`model`'s config.json beside a byte-level BPE tokenizer of `vocab_size` tokens (trained once)."""
    target = workdir / "model"
    if (target / "tokenizer.json").is_file():
        return target
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    target.mkdir(parents=True, exist_ok=True)
    texts = []
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
        try:
            texts.append(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError):  # a few test files are in other encodings on purpose
            pass
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    started = time.perf_counter()
    tok.train_from_iterator(texts, trainer)
    print(f"tokenizer: {tok.get_vocab_size()} tokens from {len(texts)} files in {time.perf_counter() - started:.0f} s",
          file=sys.stderr)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS).save_pretrained(target)
    config = json.loads((Path(bench.resolve_model(model)) / "config.json").read_text())
    config["eos_token_id"] = config["bos_token_id"] = tok.token_to_id(EOS)
    (target / "config.json").write_text(json.dumps(config, indent=1))
    return target


def timed(llm, prompts, params) -> tuple[float, list]:
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start, outs


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    bench.add_arguments(parser)
    parser.add_argument("--workdir", default="out/structured-output", help="where the model with a tokenizer is kept")
    parser.add_argument("--vocab-size", type=int, default=151643, help="tokens of the trained tokenizer")
    args = parser.parse_args(argv)
    from engine.sampling.params import SamplingParams

    args.model = str(model_with_tokenizer(args.model, Path(args.workdir), args.vocab_size))
    bench.check_arguments(args)
    prompts, params = bench.make_workload(args)
    llm = bench.build_llm(args)
    bench.warm_up(llm, args)
    host = {"seconds": 0.0, "steps": 0, "rows": 0, "masks": 0.0, "wait": 0.0}
    start, finish = llm.masks.start, llm.masks.finish
    filler = llm.masks.filler

    span: dict = {}  # this step's masks: when the first call began, when the last one ended

    def start_timed(seqs, index):  # the grammar's work on the engine's thread: follow the tokens, start the masks
        began = time.perf_counter()
        span.clear()
        pending = start(seqs, index)
        host["seconds"] += time.perf_counter() - began
        host["steps"] += 1
        host["rows"] += len(index)
        return pending

    def finish_timed(pending):  # and the wait for the masks, where their computation outlasts the work beside it
        began = time.perf_counter()
        masks = finish(pending)
        host["wait"] += time.perf_counter() - began
        if span:
            host["masks"] += span["end"] - span["begin"]
        return masks

    def filler_timed(rows, *args):  # llguidance's masks, on threads of their own
        span.setdefault("begin", time.perf_counter())
        future = filler_start(rows, *args)
        if future is not None:
            future.add_done_callback(lambda _: span.__setitem__("end", time.perf_counter()))
        else:
            span.setdefault("end", time.perf_counter())
        return future

    filler_start = filler.start
    llm.masks.start, llm.masks.finish = start_timed, finish_timed
    filler.start = filler_timed
    constrained = [SamplingParams(temperature=args.temperature, max_tokens=p.max_tokens, json_schema=SCHEMA)
                   for p in params]
    llm.generate(prompts[:32], constrained[:32], use_tqdm=False)  # compiles the grammar, warms the masked path
    # a first whole run: the constraint's start matchers build their lexers' states as masks first need them
    # (a batch job of thousands of documents under one schema pays that once); timed, and reported apart
    cold_seconds = timed(llm, prompts, constrained)[0]
    host.update(seconds=0.0, steps=0, rows=0, masks=0.0, wait=0.0)
    runs = {"constrained": [], "unconstrained": []}
    c_seconds, outs = timed(llm, prompts, constrained)
    runs["constrained"].append(c_seconds)
    steps = dict(host)
    lengths = [len(o.token_ids) for o in outs]
    valid = sum(_valid(o.text) for o in outs if o.finish_reason == "stop")
    stopped = sum(o.finish_reason == "stop" for o in outs)
    same_lengths = [SamplingParams(temperature=args.temperature, max_tokens=n, ignore_eos=True) for n in lengths]
    for _ in range(2):
        seconds, u_outs = timed(llm, prompts, same_lengths)
        runs["unconstrained"].append(seconds)
        assert [len(o.token_ids) for o in u_outs] == lengths
        if len(runs["constrained"]) < 2:
            runs["constrained"].append(timed(llm, prompts, constrained)[0])
    tokens = sum(lengths)
    mean = {k: sum(v) / len(v) for k, v in runs.items()}
    record = {
        "gpu": bench.gpu_name(), "commit": bench.git_commit(args.commit), "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "num_seqs": len(prompts), "tokens": tokens, "vocab": len(llm.tokenizer),
        "completions_ended_by_json": stopped, "of_those_valid": valid,
        "first_constrained_seconds": round(cold_seconds, 3),
        "constrained_seconds": [round(s, 3) for s in runs["constrained"]],
        "unconstrained_seconds": [round(s, 3) for s in runs["unconstrained"]],
        "constrained_tok_s": round(tokens / mean["constrained"], 1),
        "unconstrained_tok_s": round(tokens / mean["unconstrained"], 1),
        "constrained_vs_unconstrained": round(mean["unconstrained"] / mean["constrained"], 4),
        "grammar_thread_ms_per_step": round(1000 * (steps["seconds"] + steps["wait"]) / max(steps["steps"], 1), 3),
        "of_which_mask_wait_ms_per_step": round(1000 * steps["wait"] / max(steps["steps"], 1), 3),
        "mask_ms_per_step": round(1000 * steps["masks"] / max(steps["steps"], 1), 3),
        "constrained_rows_per_step": round(steps["rows"] / max(steps["steps"], 1), 1),
        "host_cpus": len(os.sched_getaffinity(0)),  # llguidance's threads: 80% of them, at most 32
    }
    print(f"{tokens} tokens: constrained {record['constrained_tok_s']:,.0f} tok/s, unconstrained "
          f"{record['unconstrained_tok_s']:,.0f} tok/s ({record['constrained_vs_unconstrained']:.3f}); grammar "
          f"{record['grammar_thread_ms_per_step']} ms of the engine thread's time a step, masks "
          f"{record['mask_ms_per_step']} ms beside it", file=sys.stderr)
    print(json.dumps(record), flush=True)
    llm.shutdown()
    return 0 if stopped == valid else 1


def _valid(text: str) -> bool:
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), SCHEMA)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


if __name__ == "__main__":
    sys.exit(main())
