#!/usr/bin/env bash
# Reproduces docs/performance.md's engine and user-path figures as an A/B on one GPU: a base tree (e.g.
# `git worktree add ../base COMMIT`) against this tree, alternating, each run its own process.
#   bash bench/ab.sh BASE_TREE     (logs under $OUT or ./out; ROUNDS=2; BENCH_ARGS go to every engine run)
# WORKLOADS (default: all) picks from: nano-bench batch-1 fp8-kv (the engine alone), queue (`redline bench
# --through-queue`: the same jobs through Redis and the worker) and gateway (bench/gateway_throughput.py: the
# engine alone, the queue and the HTTP gateway in one process). queue and gateway need the queue's
# dependencies (redis, pydantic; openai for gateway): without them they are skipped, and said so.
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
run() {  # run TREE NAME WORKLOAD ARGS...: one process; its JSON record goes to ab.jsonl, labelled
  local tree=$1 name=$2 workload=$3; shift 3
  count=$((count + 1))
  local log="$OUT/run$count.log" record cmd
  echo "== $workload, $name ($log)"
  case $workload in
    queue) cmd="python3 -m worker.cli bench --through-queue" ;;
    gateway) cmd="python3 bench/gateway_throughput.py"
      if [ ! -f "$tree/bench/gateway_throughput.py" ]; then echo "   skipped: $name has no gateway bench"; return; fi ;;
    *) cmd="python3 -m worker.bench_engine"
      [ -f "$tree/worker/bench_engine.py" ] || cmd="python3 -m engine.bench" ;;  # a base tree from before the bench left engine/
  esac
  (cd "$tree" && timeout "${BENCH_TIMEOUT:-300}" $cmd "$@" ${BENCH_ARGS:-}) > "$log" 2>&1 || status=1
  record=$(grep '^{' "$log" | tail -n 1)
  if [ -n "$record" ]; then
    echo "{\"tree\": \"$name\", \"workload\": \"$workload\", \"record\": $record}" >> "$OUT/ab.jsonl"
    grep -v '^{' "$log" | grep -i -e 'tok/s' -e warning | sed 's/^/   /'
  else
    status=1; echo "   failed:"; tail -n 5 "$log" | sed 's/^/   /'
  fi
}
has() { python3 -c "import $1" 2>/dev/null; }
BATCH1="--num-seqs 1 --min-input-len 512 --max-input-len 512 --min-output-len 512 --max-output-len 512"
for workload in ${WORKLOADS:-nano-bench batch-1 fp8-kv queue gateway}; do
  case $workload in
    nano-bench) args="" ;;
    batch-1) args=$BATCH1 ;;
    fp8-kv) args="--kv-cache-dtype fp8" ;;
    queue) has "redis, pydantic" || { echo "== queue skipped: needs redis and pydantic"; continue; }; args="" ;;
    gateway) has "redis, pydantic, openai" || { echo "== gateway skipped: needs redis, pydantic, openai"; continue; }
      args="" ;;
    *) echo "unknown workload $workload (nano-bench batch-1 fp8-kv queue gateway)" >&2; exit 2 ;;
  esac
  for round in $(seq "${ROUNDS:-2}"); do
    run "$base" "$BASE_NAME" "$workload" $args
    run "$here" "$HERE_NAME" "$workload" $args
  done
done
echo "== summary (each run its own process, in this order; the means compare tok/s)"
python3 - "$OUT/ab.jsonl" "$BASE_NAME" "$HERE_NAME" <<'PY'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]


def figures(r):  # (label, seconds, tok/s, what else to print) of one record
    rec, w = r["record"], r["workload"]
    if w == "queue":
        return "queue", rec["queue_seconds"], rec["queue_tok_s"], f"{rec['queue_vs_raw']:.3f} of its engine alone"
    if w == "gateway":
        return ("gateway", rec["gateway_seconds"], rec["gateway_tok_s"],
                f"{rec['gateway_vs_raw']:.3f} of its engine alone (queue {rec['queue_vs_raw']:.3f})")
    return w, rec["seconds"], rec["tok_s"], (f"x floor {rec['ratio_to_floor'] or float('nan'):.2f}, "
                                             f"compiled in run {rec['kernels_compiled_in_run']}")


print(f"{'workload':11s} {'tree':>14s}  {'seconds':>8s} {'tok/s':>9s}")
for r in rows:
    w, secs, toks, more = figures(r)
    print(f"{w:11s} {r['tree']:>14s}  {secs:8.3f} {toks:9,.0f}  {more}")
for workload in dict.fromkeys(r["workload"] for r in rows):
    means = []
    for tree in sys.argv[2:]:
        toks = [figures(r)[2] for r in rows if r["workload"] == workload and r["tree"] == tree]
        means.append(sum(toks) / len(toks) if toks else float("nan"))
    print(f"{workload}: {sys.argv[2]} {means[0]:,.0f} tok/s, {sys.argv[3]} {means[1]:,.0f} tok/s (mean), "
          f"{sys.argv[3]} / {sys.argv[2]} = {means[1] / means[0]:.3f}")
PY
exit $status
