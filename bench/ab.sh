#!/usr/bin/env bash
# Reproduces docs/performance.md's engine figures (nano-bench, batch 1, fp8 KV) as an A/B on one GPU: a base
# tree (e.g. `git worktree add ../base COMMIT`) against this tree, alternating, each run its own process.
#   bash bench/ab.sh BASE_TREE     (logs under $OUT or ./out; ROUNDS=2; BENCH_ARGS go to every run)
set -uo pipefail
if [ $# -ne 1 ] || [ ! -d "$1/engine" ]; then
  echo "usage: bash bench/ab.sh BASE_TREE   (a directory holding another tree's engine/, e.g. made with" \
       "'git worktree add ../base COMMIT'; BASE_NAME and HERE_NAME label the trees)" >&2
  exit 2
fi
base=$(cd "$1" && pwd)
here=$(cd "$(dirname "$0")/.." && pwd)
OUT="${OUT:-out}"; mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
export PYTHONUNBUFFERED=1
label() {  # a tree's commit, if it is a git checkout of its own (a copy inside another repo would name that one)
  if [ -e "$1/.git" ]; then git -C "$1" describe --always --dirty 2>/dev/null || basename "$1"; else basename "$1"; fi
}
BASE_NAME="${BASE_NAME:-$(label "$base")}"
HERE_NAME="${HERE_NAME:-$(label "$here")}"
[ "$BASE_NAME" = "$HERE_NAME" ] && HERE_NAME="$HERE_NAME (here)"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>&1 | tee "$OUT/gpu.txt"
: > "$OUT/ab.jsonl"
status=0
count=0
run() {  # run TREE NAME WORKLOAD ARGS...: one engine process; its JSON record goes to ab.jsonl, labelled
  local tree=$1 name=$2 workload=$3; shift 3
  count=$((count + 1))
  local log="$OUT/run$count.log" record
  echo "== $workload, $name ($log)"
  local module=worker.bench_engine
  [ -f "$tree/worker/bench_engine.py" ] || module=engine.bench  # a base tree from before the bench left engine/
  (cd "$tree" && timeout "${BENCH_TIMEOUT:-300}" python3 -m $module "$@" ${BENCH_ARGS:-}) > "$log" 2>&1 || status=1
  record=$(grep '^{' "$log" | tail -n 1)
  if [ -n "$record" ]; then
    echo "{\"tree\": \"$name\", \"workload\": \"$workload\", \"record\": $record}" >> "$OUT/ab.jsonl"
    grep -v '^{' "$log" | grep -i -e 'tok/s' -e warning | sed 's/^/   /'
  else
    status=1; echo "   failed:"; tail -n 5 "$log" | sed 's/^/   /'
  fi
}
BATCH1="--num-seqs 1 --min-input-len 512 --max-input-len 512 --min-output-len 512 --max-output-len 512"
for workload in nano-bench batch-1 fp8-kv; do
  case $workload in
    nano-bench) args="" ;;
    batch-1) args=$BATCH1 ;;
    fp8-kv) args="--kv-cache-dtype fp8" ;;
  esac
  for round in $(seq "${ROUNDS:-2}"); do
    run "$base" "$BASE_NAME" "$workload" $args
    run "$here" "$HERE_NAME" "$workload" $args
  done
done
echo "== summary (seconds, tok/s, x floor; each run its own process, in this order)"
python3 - "$OUT/ab.jsonl" "$BASE_NAME" "$HERE_NAME" <<'PY'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
print(f"{'workload':11s} {'tree':>14s}  {'seconds':>8s} {'tok/s':>9s} {'x floor':>7s}  compiled in run")
for r in rows:
    rec = r["record"]
    print(f"{r['workload']:11s} {r['tree']:>14s}  {rec['seconds']:8.3f} {rec['tok_s']:9,.0f} "
          f"{rec['ratio_to_floor'] or float('nan'):7.2f}  {rec['kernels_compiled_in_run']}")
for workload in dict.fromkeys(r["workload"] for r in rows):
    means = []
    for tree in sys.argv[2:]:
        secs = [r["record"]["seconds"] for r in rows if r["workload"] == workload and r["tree"] == tree]
        means.append(sum(secs) / len(secs) if secs else float("nan"))
    print(f"{workload}: {sys.argv[2]} {means[0]:.3f} s, {sys.argv[3]} {means[1]:.3f} s (mean), "
          f"{sys.argv[3]} / {sys.argv[2]} = {means[1] / means[0]:.3f}")
PY
exit $status
