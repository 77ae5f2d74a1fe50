#!/usr/bin/env bash
# The GPU tests (every test marked gpu: the engine and each family against HF transformers in bf16, the
# kernels, sampling, breadth, structured output, images; those needing 2 or 4 GPUs skip on fewer), then the
# runs behind docs/performance.md's engine figures (nano-bench, batch 1, fp8 KV).   bash bench/gpu_check.sh
#   logs under $OUT (default ./out); the tests take about 15 minutes on one H100: TESTS=... picks test files,
#   SKIP_TESTS=1 skips them, TEST_TIMEOUT (s) bounds them, BENCH_ARGS go to each run
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-out}"; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>&1 | tee "$OUT/gpu.txt"
status=0
if [ -z "${SKIP_TESTS:-}" ]; then
  timeout "${TEST_TIMEOUT:-1800}" python3 -m pytest -q -m gpu -p no:cacheprovider -rf \
    ${TESTS:-tests} 2>&1 | tee "$OUT/gpu_tests.log" || status=1
fi
# each run its own process; the first engine process on a fresh machine runs a few percent slower
timeout "${BENCH_TIMEOUT:-300}" python3 -m worker.bench_engine ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log" || status=1
timeout "${BENCH_TIMEOUT:-300}" python3 -m worker.bench_engine --num-seqs 1 --min-input-len 512 --max-input-len 512 \
  --min-output-len 512 --max-output-len 512 ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench_batch1.log" || status=1
timeout "${BENCH_TIMEOUT:-300}" python3 -m worker.bench_engine --kv-cache-dtype fp8 ${BENCH_ARGS:-} 2>&1 \
  | tee "$OUT/bench_fp8.log" || status=1
echo "== summary"; grep -h '^{' "$OUT"/bench*.log; tail -n 1 "$OUT/gpu_tests.log" 2>/dev/null
exit $status
