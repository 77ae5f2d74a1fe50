"""TP=2 vs TP=1 first-token logprobs on the same dummy checkpoint (GPU): a sharding error moves them by
whole nats, bf16 summation order by hundredths. Run under `python scripts/tp_logprobs_check.py`."""
import json
import random
import sys

from engine import LLM, SamplingParams


def first_token_logprobs(tp: int, prompts, model: str) -> list[dict]:
    llm = LLM(model, load_format="dummy", tensor_parallel_size=tp, num_kvcache_blocks=64,
              max_model_len=1024)  # fixed: an earlier engine in this process may still hold memory
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=1, logprobs=5), use_tqdm=False)
    llm.shutdown()
    return [o.logprobs[0]["top"] for o in outs]


if __name__ == "__main__":
    model = sys.argv[1] if len(sys.argv) > 1 else "engine/configs/qwen3-0.6b"
    rng = random.Random(0)
    prompts = [[rng.randint(0, 10000) for _ in range(rng.randint(20, 500))] for _ in range(16)]
    one, two = first_token_logprobs(1, prompts, model), first_token_logprobs(2, prompts, model)
    diffs, same_top, margins = [], 0, []
    for a, b in zip(one, two):
        shared = set(a) & set(b)
        diffs += [abs(a[t] - b[t]) for t in shared]
        best_a, best_b = max(a, key=a.get), max(b, key=b.get)
        same_top += best_a == best_b
        ranked = sorted(a.values(), reverse=True)
        margins.append(round(ranked[0] - ranked[1], 4))
    print(json.dumps({"max_abs_logprob_diff": max(diffs), "mean_abs_logprob_diff": sum(diffs) / len(diffs),
                      "same_top1": f"{same_top}/{len(prompts)}", "tp1_top1_top2_margins": margins}))
