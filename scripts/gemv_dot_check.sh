#!/usr/bin/env bash
# One call on the GPU machine for the GEMV's tensor-core kernel (engine/kernels/gemv.py, rows above
# DOT_ABOVE_ROWS): decode-graph times for each variant, ROUNDS times in turn, then the GPU tests of the
# GEMV and of the engine against transformers. A variant is "ROWS[:NAME=N,...]": REDLINE_GEMV_MAX_ROWS and
# decode_graph_time.py's --gemv-set. Logs under $OUT.
#   VARIANTS="2 16 16:DOT_WIDE_K=4096" BATCHES=1,2,4,8,16 ROUNDS=2 bash scripts/gemv_dot_check.sh
# GRAPH_ARGS are more decode_graph_time.py arguments (e.g. --model engine/configs/qwen3-8b); TIMEOUT a run's seconds.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-out}"; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=.
nvidia-smi --query-gpu=name --format=csv,noheader 2>&1 | tee "$OUT/gpu.txt"
for round in $(seq "${ROUNDS:-2}"); do
  for variant in ${VARIANTS:-2 16}; do
    rows="${variant%%:*}"; set_="${variant#*:}"; [ "$set_" = "$variant" ] && set_=""
    echo "== round $round REDLINE_GEMV_MAX_ROWS=$rows --gemv-set '$set_'" | tee -a "$OUT/graph.log"
    REDLINE_GEMV_MAX_ROWS=$rows timeout "${TIMEOUT:-150}" python3 scripts/decode_graph_time.py \
      --batches "${BATCHES:-1,2,4,8,16}" --max-num-seqs 64 --gemv-set "$set_" ${GRAPH_ARGS:-} 2>&1 \
      | grep -v Warning | tail -3 | tee -a "$OUT/graph.log"
  done
done
python3 - "$OUT/graph.log" <<'PY'
import json, sys
rows, name = [], None
for line in open(sys.argv[1]):
    if line.startswith("=="):
        name = line.split(" ", 3)[3].strip()
    elif line.startswith('{"gpu"'):
        steps = json.loads(line)["steps"]
        rows.append((name, {b: s["graph_ms"] for b, s in steps.items()}))
batches = list(rows[0][1]) if rows else []
print("variant".ljust(60), *[f"b{b}".rjust(8) for b in batches])
for name, ms in rows:
    print(name[:60].ljust(60), *[f"{ms[b]:8.4f}" for b in batches])
PY
if [ -z "${SKIP_TESTS:-}" ]; then
  timeout 200 python3 -m pytest -q -m gpu tests/test_gemv.py 2>&1 | tail -4 | tee "$OUT/tests.log"
  timeout 300 python3 -m pytest -q -m gpu tests/test_gpu_engine.py -s \
    -k "${TESTS:-dot-gemv or decode-stack or programmatic}" \
    2>&1 | grep -E "equal|passed|failed|Error|assert" | tail -20 | tee -a "$OUT/tests.log"
fi
