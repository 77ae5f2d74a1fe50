#!/usr/bin/env bash
# One call on the GPU machine for the GEMV's tensor-core kernel (engine/kernels/gemv.py, rows above
# DOT_ABOVE_ROWS): decode-graph times with the GEMV up to 2 rows (cuBLAS past them) against up to ROWS rows,
# alternating, then the GPU tests of the GEMV and of the engine against transformers. Logs under $OUT.
#   ROWS=16 BATCHES=1,2,4,8,16 ROUNDS=2 bash scripts/gemv_dot_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-out}"; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=.
nvidia-smi --query-gpu=name --format=csv,noheader 2>&1 | tee "$OUT/gpu.txt"
git log -1 --format=%h 2>/dev/null | tee -a "$OUT/gpu.txt"
for round in $(seq "${ROUNDS:-2}"); do
  for rows in 2 "${ROWS:-16}"; do
    echo "== round $round REDLINE_GEMV_MAX_ROWS=$rows" | tee -a "$OUT/graph.log"
    REDLINE_GEMV_MAX_ROWS=$rows timeout 150 python3 scripts/decode_graph_time.py --batches "${BATCHES:-1,2,4,8,16}" \
      --max-num-seqs 64 2>&1 | grep -v Warning | tail -3 | tee -a "$OUT/graph.log"
  done
done
if [ -z "${SKIP_TESTS:-}" ]; then
  timeout 200 python3 -m pytest -q -m gpu tests/test_gemv.py 2>&1 | tail -4 | tee "$OUT/tests.log"
  timeout 300 python3 -m pytest -q -m gpu tests/test_gpu_engine.py -s -k "${TESTS:-dot-gemv or decode-stack or programmatic}" \
    2>&1 | grep -E "equal|passed|failed|Error|assert" | tail -20 | tee -a "$OUT/tests.log"
fi
