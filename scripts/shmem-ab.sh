#!/usr/bin/env bash
# The same attached job with the store's shared memory on small pages and on huge pages
# (docs/BENCHMARKS.md "Huge pages under every O_DIRECT read"). Needs root: it switches
# /sys/kernel/mm/transparent_hugepage/shmem_enabled between `never` and `advise` around each store
# start, and puts the original value back on exit. Same binaries for both sides.
#
#   scripts/shmem-ab.sh MODEL TRUNK TRUNK_GB CACHE_GB GEN REPS OUTDIR
#
# Each run: `k3-store start --detach` at the budget, one `k3-worker` attached (prompt ids
# 17,200,3,99,42, --gen GEN, --prefill-chunk 1, --spec off, --out OUTDIR/<mode><rep>.json),
# `k3-ctl stop`. Prints the store's start time and the decode median per run; fails if the ids
# of any run differ from the first run's.
set -euo pipefail
if [ $# -ne 7 ]; then
    sed -n 2,12p "$0" >&2
    exit 2
fi
MODEL=$1 TRUNK=$2 TGB=$3 CGB=$4 GEN=$5 REPS=$6 OUT=$7
KNOB=/sys/kernel/mm/transparent_hugepage/shmem_enabled
BIN=${K3_BIN:-$(cd "$(dirname "$0")/.." && pwd)/target/release}
orig=$(sed -e 's/.*\[\(.*\)\].*/\1/' "$KNOB")
trap 'echo "$orig" > "$KNOB"; rm -rf "${sockdir:-}"' EXIT
mkdir -p "$OUT"
sockdir=$(mktemp -d)   # mode 700: the store refuses a socket directory others can write
sock=$sockdir/store.sock
first=""
for rep in $(seq 1 "$REPS"); do
    for mode in never advise; do
        echo "$mode" > "$KNOB"
        t0=$(date +%s.%N)
        "$BIN/k3-store" start "$MODEL" --trunk "$TRUNK" --trunk-gb "$TGB" --cache-gb "$CGB" \
            --socket "$sock" --detach --log "$OUT/store-$mode$rep.log" > /dev/null
        t1=$(date +%s.%N)
        "$BIN/k3-worker" --socket "$sock" --ids 17,200,3,99,42 --gen "$GEN" --prefill-chunk 1 \
            --spec off --out "$OUT/$mode$rep.json" > /dev/null 2> "$OUT/worker-$mode$rep.err"
        "$BIN/k3-ctl" stop --socket "$sock" > /dev/null
        ids=$(python3 - "$OUT/$mode$rep.json" "$t0" "$t1" "$mode$rep" <<'PY'
import json, statistics, sys
r = json.load(open(sys.argv[1]))
d = [s["seconds"] for s in r["steps"][1:]]
print(f"{sys.argv[4]:<10} store start {float(sys.argv[3]) - float(sys.argv[2]):6.2f} s  "
      f"decode median {statistics.median(d):.4f} s/token  read {r['bytes_read'] / 1e9:.2f} GB",
      file=sys.stderr)
print(",".join(map(str, r["generated_ids"])))
PY
)
        if [ -z "$first" ]; then
            first=$ids
        elif [ "$ids" != "$first" ]; then
            echo "shmem-ab: ids differ in $mode$rep" >&2
            exit 1
        fi
    done
done
echo "ids identical in every run"
