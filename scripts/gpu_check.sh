#!/usr/bin/env bash
# One call on the GPU machine: kernel correctness + CUDA-graph capture + timings, then the engine bench.
#   bash scripts/gpu_check.sh            (logs under $OUT, or ./out)
#   SKIP_BENCH=1 SKIP_SWEEP=1 bash scripts/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-out}"; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv 2>&1 | tee "$OUT/gpu.txt"
status=0
python3 scripts/kernel_check.py --out "$OUT" ${SKIP_SWEEP:+--skip-sweep} 2>&1 | tee "$OUT/kernel_check.log" || status=1
if [ -z "${SKIP_BENCH:-}" ]; then
  # the engine alone on nano-vllm's workload; bounded so a slow engine cannot eat the call
  timeout "${BENCH_TIMEOUT:-200}" python3 -m engine.bench ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log" || status=1
fi
exit $status
