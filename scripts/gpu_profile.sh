#!/usr/bin/env bash
# One call on the GPU machine: where nano-bench's time goes at this commit (wall time by step kind, GPU
# time by kernel kind, Chrome traces of a few steps and their summaries), the same for the batch-1 bench,
# the GPU's read bandwidth, and the GEMV-chain check.   bash scripts/gpu_profile.sh   (logs under $OUT)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-out}"; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=.
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv,noheader 2>&1 | tee "$OUT/gpu.txt"
python3 - <<'PY' 2>&1 | tee "$OUT/bandwidth.txt"
import torch, triton
x = torch.randn(1 << 31, device="cuda", dtype=torch.bfloat16)  # 4.3 GB
y = torch.empty_like(x)
read = triton.testing.do_bench(lambda: x.sum(dtype=torch.float32), warmup=50, rep=300, return_mode="median")
copy = triton.testing.do_bench(lambda: y.copy_(x), warmup=50, rep=300, return_mode="median")
print(f"read {x.numel() * 2 / read / 1e9:.3f} TB/s (sum), copy {2 * x.numel() * 2 / copy / 1e9:.3f} TB/s (read + written)")
PY
timeout 240 python3 scripts/pdl_gemv_check.py 2>&1 | tee "$OUT/pdl_gemv.log"
timeout 300 python3 scripts/bench_profile.py --profile --trace ${TRACE_STEPS:-30-30,500-500,950-950} \
  --out "$OUT/prof" ${BENCH_ARGS:-} 2>&1 | grep -v Warning | tee "$OUT/profile.log"
timeout 150 python3 scripts/bench_profile.py --num-seqs 1 --min-input-len 512 --max-input-len 512 \
  --min-output-len 512 --max-output-len 512 --trace 300-300 --out "$OUT/b1" 2>&1 | grep -v Warning | tee "$OUT/profile_b1.log"
for t in "$OUT"/prof/trace_*.json "$OUT"/b1/trace_*.json; do
  [ -f "$t" ] && python3 scripts/trace_summary.py "$t" --timeline 80 > "${t%.json}.txt" 2>&1
  head -30 "${t%.json}.txt"
done
echo "== summary"; cat "$OUT/bandwidth.txt"; grep -h '^{' "$OUT/pdl_gemv.log" "$OUT/profile.log" "$OUT/profile_b1.log"
