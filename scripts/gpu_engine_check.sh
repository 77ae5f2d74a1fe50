#!/usr/bin/env bash
# One call on the GPU machine: GPU tests (kernels, engine vs transformers bf16), then the benchmarks.
#   bash scripts/gpu_engine_check.sh       (logs under $OUT, or ./out)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-out}"; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>&1 | tee "$OUT/gpu.txt"
status=0
if [ -z "${SKIP_TESTS:-}" ]; then
  timeout "${TEST_TIMEOUT:-300}" python3 -m pytest ${PYTEST_ARGS:--x -q} -m gpu -p no:cacheprovider ${TESTS:-tests/test_kernels.py tests/test_gpu_engine.py} 2>&1 \
    | tee "$OUT/gpu_tests.log" || status=1
fi
# nano-vllm's workload on the Qwen3-0.6B shape, then decode at batch 1 (512-token prompt, 512 new tokens)
timeout "${BENCH_TIMEOUT:-180}" python3 -m engine.bench ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log" || status=1
timeout 120 python3 -m engine.bench --num-seqs 1 --min-input-len 512 --max-input-len 512 \
  --min-output-len 512 --max-output-len 512 ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench_batch1.log" || status=1
echo "== summary"; grep -h '^{' "$OUT"/bench*.log; tail -n 3 "$OUT/gpu_tests.log" 2>/dev/null
exit $status
