#!/usr/bin/env bash
# One call on the GPU machine: the fused MLP kernel (engine/kernels/mlp.py) checked, then decode graphs at
# 1, 2 and 4 rows with and without it, alternating (ratios within the call are fair), a sizing sweep, the
# batch-1 bench either way, and the GPU tests that take the fused path.   bash scripts/mlp_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-out}"; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=.
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$OUT/gpu.txt"
status=0
timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_fused_mlp.py 2>&1 | tee "$OUT/mlp_tests.log" \
  | tail -n 3 || status=1
graphs() {  # name, env, extra args
  echo "== $1" | tee -a "$OUT/graphs.log"
  env $2 timeout 150 python3 scripts/decode_graph_time.py --batches 1,2,4 --max-num-seqs 4 ${3:-} 2>&1 \
    | grep -v Warning | tee -a "$OUT/graphs.log" | grep -e '^{"gpu' -e '^{"fused_decode' || status=1
}
for round in 1 2; do
  graphs "unfused, round $round" REDLINE_FUSED_MLP_ROWS=0
  graphs "fused, round $round" REDLINE_FUSED_MLP_ROWS=2
done
for variant in "MAX_SLICE=12288" "NUM_WARPS=4" "MAX_SLICE=12288,NUM_WARPS=4" "NUM_WARPS=16"; do
  graphs "fused $variant" REDLINE_FUSED_MLP_ROWS=2 "--mlp-set $variant"
done
for rows in 0 2; do
  echo "== batch-1 bench, REDLINE_FUSED_MLP_ROWS=$rows" | tee -a "$OUT/bench.log"
  REDLINE_FUSED_MLP_ROWS=$rows timeout 120 python3 -m engine.bench --num-seqs 1 --min-input-len 512 \
    --max-input-len 512 --min-output-len 512 --max-output-len 512 2>&1 | grep -v Warning | tee -a "$OUT/bench.log" \
    | grep '^{' || status=1
done
if [ -z "${SKIP_TESTS:-}" ]; then
  timeout "${TEST_TIMEOUT:-240}" python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu_engine.py \
    -k "small-batches or sample or programmatic" 2>&1 | tee "$OUT/gpu_tests.log" | tail -n 3 || status=1
fi
echo "== summary"; grep -h -e '^==' -e '^{"gpu' "$OUT/graphs.log"; grep -h '^{' "$OUT/bench.log"
exit $status
