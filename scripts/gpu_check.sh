#!/usr/bin/env bash
# One call on the GPU machine: kernel correctness + CUDA-graph capture + timings, the engine bench,
# and, when both halves of flash-attn 4 were carried (.whl/fa4a and .whl/fa4b, see scripts/pack_fa4.sh),
# the flash backend on it.
#   bash scripts/gpu_check.sh            (logs under $OUT, or ./out)
#   SKIP_BENCH=1 SKIP_SWEEP=1 bash scripts/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-out}"; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv 2>&1 | tee "$OUT/gpu.txt"
status=0
python3 scripts/kernel_check.py --out "$OUT" ${SKIP_SWEEP:+--skip-sweep} 2>&1 | tee "$OUT/kernel_check.log" | tail -70 || status=1
if [ -z "${SKIP_BENCH:-}" ]; then
  # the engine alone on nano-vllm's workload; bounded so a slow engine cannot eat the call
  timeout -s INT "${BENCH_TIMEOUT:-200}" ${BENCH_CMD:-python3 -m engine.bench} 2>&1 | tee "$OUT/bench.log" | tail -8 || status=1
fi
if ls .whl/fa4a/fa4site.tar.xz.part-* .whl/fa4b/fa4site.tar.xz.part-* >/dev/null 2>&1; then
  site=/tmp/fa4site; mkdir -p "$site" && cat .whl/fa4a/fa4site.tar.xz.part-* .whl/fa4b/fa4site.tar.xz.part-* | tar -C "$site" -xJf -
  PYTHONPATH="$site/nvidia_cutlass_dsl/dsl_packages:$site" timeout -s INT "${FLASH_TIMEOUT:-200}" \
    python3 scripts/kernel_check.py --backend flash --out "$OUT" 2>&1 | tee "$OUT/flash.log" | tail -40 || status=1
fi
exit $status
