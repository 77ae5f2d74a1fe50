#!/usr/bin/env bash
# One call on the GPU machine: the persistent decode kernel (REDLINE_DECODE_PERSISTENT) checked and timed.
#   bash scripts/persistent_check.sh          (logs under $OUT, or ./out)
# 1. the fused decode GPU tests (grid and persistent kernels against the reference and each other);
# 2. nano-bench's decode attention replayed (scripts/attention_replay.py) for the grid kernel and the
#    persistent variants in VARIANTS, one layer, every EVERY-th step;
# 3. nano-bench with the grid kernel and with the variant whose replayed attention was shortest,
#    alternating, ROUNDS times each.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-out}"; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=.
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>&1 | tee "$OUT/gpu.txt"
git rev-parse --short HEAD 2>/dev/null | tee -a "$OUT/gpu.txt"
VARIANTS="${VARIANTS:-engine,persistent3,persistent4,persistent3_prefetch,persistent4_prefetch}"
if [ -z "${SKIP_TESTS:-}" ]; then
  timeout "${TEST_TIMEOUT:-150}" python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_fused_decode.py 2>&1 \
    | grep -v Warn | tail -n 15 | tee "$OUT/tests.log"
fi
timeout "${REPLAY_TIMEOUT:-240}" python3 scripts/attention_replay.py --every "${EVERY:-200}" --variants "$VARIANTS" \
  2>&1 | grep -v Warn > "$OUT/replay.log"
best=$(tail -n 1 "$OUT/replay.log" | python3 -c '
import json, sys
run = json.load(sys.stdin)["run_attention_s"]
for name, seconds in sorted(run.items(), key=lambda kv: kv[1]):
    print(f"{name} {seconds:.4f}", file=sys.stderr)
run.pop("engine")
name = min(run, key=run.get)
print(name.replace("persistent", "").replace("_prefetch", "+prefetch"))')
echo "best persistent setting: ${best:-none}" | tee -a "$OUT/summary.log"
[ -n "$best" ] || exit 1
for round in $(seq "${ROUNDS:-2}"); do
  for setting in 0 "$best"; do
    REDLINE_DECODE_PERSISTENT="$setting" timeout "${BENCH_TIMEOUT:-150}" python3 -m engine.bench 2>&1 \
      | grep '^{' | tail -n 1 > "$OUT/bench.json"
    python3 -c "import json; d = json.load(open('$OUT/bench.json')); print('REDLINE_DECODE_PERSISTENT=$setting',
      d['seconds'], d['tok_s'], 'compiled in run:', d.get('kernels_compiled_in_run'))" 2>&1 | tee -a "$OUT/summary.log"
  done
done
