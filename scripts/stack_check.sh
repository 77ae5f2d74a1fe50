#!/usr/bin/env bash
# One call on the GPU machine for the persistent decode kernel (engine/kernels/decode_stack.py): the kernel
# against the torch reference, decode-graph times with and without it (alternating, in one run), config
# variants, and the batch-1 bench. Logs under $OUT (or ./out).
#   CONFIGS="num_warps=8 l2_ahead=0" ROUNDS=2 bash scripts/stack_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-out}"; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=.
nvidia-smi --query-gpu=name --format=csv,noheader 2>&1 | tee "$OUT/gpu.txt"
git log -1 --format=%h 2>/dev/null | tee -a "$OUT/gpu.txt"
timeout 240 python3 - <<'PY' 2>&1 | tee "$OUT/kernel.log"
import sys
sys.path.insert(0, "tests")
import torch
import decode_stack_cases as cases
for case in cases.GPU_CASES:
    for phases in (False, True):
        print(case[0], "phases" if phases else "persistent", cases.run_case(case, torch.bfloat16, "cuda", phases))
PY
graph() { env "$@" timeout 150 python3 scripts/decode_graph_time.py --batches 1,2 --max-num-seqs 64 2>&1 \
  | grep -v Warning | tail -3; }
for round in $(seq "${ROUNDS:-2}"); do
  for v in 0 1; do
    echo "== round $round REDLINE_DECODE_STACK=$v" | tee -a "$OUT/graph.log"
    graph REDLINE_DECODE_STACK=$v | tee -a "$OUT/graph.log"
  done
done
for cfg in ${CONFIGS:-}; do
  echo "== REDLINE_STACK_CONFIG=$cfg" | tee -a "$OUT/graph.log"
  graph REDLINE_DECODE_STACK=1 REDLINE_STACK_CONFIG="$cfg" | tee -a "$OUT/graph.log"
done
if [ -z "${SKIP_BATCH1:-}" ]; then
  for v in 0 1 0 1; do
    echo "== batch-1 bench REDLINE_DECODE_STACK=$v" | tee -a "$OUT/bench.log"
    REDLINE_DECODE_STACK=$v timeout 150 python3 -m engine.bench --num-seqs 1 --min-input-len 512 \
      --max-input-len 512 --min-output-len 512 --max-output-len 512 2>&1 | grep -v Warning | tail -2 \
      | tee -a "$OUT/bench.log"
  done
fi
