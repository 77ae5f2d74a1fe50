#!/usr/bin/env bash
# One call on the GPU machine: the engine's benchmarks under each of several environment settings, in
# one run (ratios between them are fair), then the GPU tests.
#   AB="REDLINE_L2_PREFETCH=0 REDLINE_L2_PREFETCH=1" bash scripts/gpu_ab.sh     (logs under $OUT, or ./out)
# Each word of AB is one variant: NAME=VALUE[,NAME=VALUE...]. STEPS=1 adds a decode-step table per variant;
# GRAPH_BATCHES=1,16,256 adds decode-graph times (scripts/decode_graph_time.py, GRAPH_ARGS passed on);
# SKIP_BENCH=1 leaves out nano-bench, SKIP_BATCH1=1 the batch-1 bench, SKIP_TESTS=1 the tests; ROUNDS=N
# runs the variants N times over, alternating. Tensor parallelism, for example:
#   AB="REDLINE_TP_OVERLAP_CHUNKS=1 REDLINE_TP_OVERLAP_CHUNKS=4" SKIP_BATCH1=1 SKIP_TESTS=1 \
#     BENCH_ARGS="--model qwen3-8b --tensor-parallel-size 2" bash scripts/gpu_ab.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-out}"; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=.
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>&1 | tee "$OUT/gpu.txt"
status=0
for round in $(seq "${ROUNDS:-1}"); do
for variant in ${AB:-REDLINE_L2_PREFETCH=1}; do
  vars=(${variant//,/ })
  name=$(echo "$variant" | tr -c 'A-Za-z0-9_\n' '_')
  echo "== $variant (round $round)" | tee -a "$OUT/ab.log"
  if [ -n "${GRAPH_BATCHES:-}" ]; then
    env "${vars[@]}" timeout "${GRAPH_TIMEOUT:-240}" python3 scripts/decode_graph_time.py --batches "$GRAPH_BATCHES" \
      ${GRAPH_ARGS:-} 2>&1 | grep -v Warning | tee -a "$OUT/graphs.log" | grep -e '^{"gpu' -e '^{"graph_edges' \
      >> "$OUT/ab.log" || status=1
  fi
  if [ -z "${SKIP_BENCH:-}" ]; then
    env "${vars[@]}" timeout "${BENCH_TIMEOUT:-180}" python3 -m engine.bench ${BENCH_ARGS:-} 2>&1 \
      | grep -v Warning | tee -a "$OUT/ab.log" || status=1
  fi
  if [ -z "${SKIP_BATCH1:-}" ]; then
    env "${vars[@]}" timeout 120 python3 -m engine.bench --num-seqs 1 --min-input-len 512 --max-input-len 512 \
      --min-output-len 512 --max-output-len 512 ${BENCH_ARGS:-} 2>&1 | grep -v Warning | tee -a "$OUT/ab.log" || status=1
  fi
  if [ -n "${STEPS:-}" ]; then
    env "${vars[@]}" timeout 240 python3 scripts/step_times.py --batches ${STEP_BATCHES:-1,64,256} --steps 32 \
      --profile-batch ${PROFILE_BATCH:-1} --out "$OUT/$name" ${BENCH_ARGS:-} 2>&1 | tee -a "$OUT/steps.log" || status=1
  fi
done
done
if [ -z "${SKIP_TESTS:-}" ]; then
  timeout "${TEST_TIMEOUT:-300}" python3 -m pytest ${PYTEST_ARGS:--q} -m gpu -p no:cacheprovider \
    ${TESTS:-tests/test_kernels.py tests/test_gpu_engine.py} 2>&1 | tee "$OUT/gpu_tests.log" || status=1
fi
echo "== summary"; grep -h -e '^==' -e '^{' "$OUT/ab.log"; grep -h '^{' "$OUT/steps.log" 2>/dev/null
tail -n 3 "$OUT/gpu_tests.log" 2>/dev/null
exit $status
