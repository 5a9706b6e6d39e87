#!/usr/bin/env bash
# k3 demo on the bundled tiny model (fixtures/tiny/model): pack its trunk, start a store, run two
# workers against it, show the warm cache in `k3-ctl stats`, stop the store.
#
#   scripts/demo.sh            # builds (debug profile, target/debug) and runs; everything else
#                              # lives in a temp dir, removed at the end
#
# Exit status is non-zero if any step fails. The two workers must print identical ids; the second
# one's TRUE resident hit rate is 100% because the first one's experts are still in the store.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)

echo "== building k3-store, k3-worker, k3-ctl into target/debug (cargo build --workspace --bins;"
echo "   a first build compiles ~250 crates: several minutes on 2 cores, cargo shows its progress)"
cargo build --workspace --bins
BIN="$ROOT/target/debug"

WORK=$(mktemp -d -t k3-demo.XXXXXX)
SOCK="$WORK/run/store.sock"
cleanup() {
  if [ -S "$SOCK" ]; then "$BIN/k3-ctl" stop --socket "$SOCK" >/dev/null 2>&1 || true; fi
  rm -rf "$WORK"
}
trap cleanup EXIT

MODEL="$ROOT/fixtures/tiny/model"
PROMPT="17,200,3,99,42,128,7,255,64,1,180,33"

echo
echo "== the checkpoint"
"$BIN/k3-ctl" inspect "$MODEL" | sed -n '1,12p'

echo
echo "== packing the trunk (each layer's non-expert tensors as one 4 KiB-aligned run)"
"$BIN/k3-ctl" pack-trunk "$MODEL" "$WORK/trunk" | tail -n 1

echo
echo "== starting the store (laptop preset: every layer of this tiny model fits in the trunk budget)"
# The laptop arena holds every expert of this tiny model, so by default (--preload auto) the
# store would read them all before serving and the first worker would already hit every one.
# --preload off shows the cache filling up from the jobs' own requests instead.
"$BIN/k3-store" start "$MODEL" --trunk "$WORK/trunk" --preset laptop --preload off \
  --socket "$SOCK" --detach
"$BIN/k3-ctl" status --socket "$SOCK" | sed -n '1,8p'

run_worker() { # run_worker N
  echo
  echo "== worker $1: 8 greedy tokens after a 12-token prompt"
  "$BIN/k3-worker" --socket "$SOCK" --ids "$PROMPT" --gen 8 --out "$WORK/worker$1.json" \
    2> "$WORK/worker$1.err" | tee "$WORK/worker$1.out"
  grep -E "attached|TRUE resident hit rate|bytes read|PEAK RSS" "$WORK/worker$1.err" || true
}

run_worker 1
echo
echo "== k3-ctl stats after worker 1 (cold store: each expert was read once; its repeats within the job were hits)"
"$BIN/k3-ctl" stats --socket "$SOCK"

run_worker 2
echo
echo "== k3-ctl stats after worker 2 (warm cache)"
"$BIN/k3-ctl" stats --socket "$SOCK"

python3 - "$WORK/worker1.json" "$WORK/worker2.json" "$WORK/trunk/trunk.json" <<'PY'
import json, sys
a, b, trunk = (json.load(open(p)) for p in sys.argv[1:4])
trunk_mb = sum(layer["nbytes"] for layer in trunk["layers"]) / 1e6
n_layers = len(trunk["layers"])
print()
for n, r in (("worker 1", a), ("worker 2", b)):
    print(f"{n}: ids {r['generated_ids']}  TRUE resident hit rate {100*r['true_resident_hit_rate']:.1f}%"
          f"  expert bytes read {r['expert_bytes_read']}  trunk bytes read {r['trunk_bytes_read']}")
assert a["generated_ids"] == b["generated_ids"], "workers disagree"
assert b["true_resident_hit_rate"] == 1.0, "second worker should hit every expert"
assert b["trunk_bytes_read"] == 0 and b["expert_bytes_read"] == 0
print("identical ids; the second worker found every expert resident (TRUE hit rate 100%) and read "
      f"no bytes from disk: all {n_layers} trunk layers are pinned in the store's shared memory, so "
      f"neither worker read the {trunk_mb:.2f} MB of trunk that a standalone run reads")
PY

echo
echo "== stopping the store"
"$BIN/k3-ctl" stop --socket "$SOCK"
test ! -e "$SOCK" && echo "socket removed; shared memory (a memfd) went with the process"

# ---- the trained proxy (issue #31) ------------------------------------------------------------
echo
echo "== the trained proxy: K3's tensor graph trained here on Django's documentation and source"
echo "   (fixtures/trained/compact.npz expanded to a 180 MB K3 checkpoint; scripts/train_k3.py)"
if python3 -c "import numpy" 2>/dev/null; then
  python3 scripts/train_k3.py "$WORK/trained" --expand fixtures/trained/compact.npz
  for prompt in "To create a new Django project, run" "from django.db import models"; do
    echo "-- prompt: $prompt"
    "$BIN/k3-worker" --standalone "$WORK/trained" --tok fixtures/tokenizer --prompt "$prompt" \
      --gen 48 2>/dev/null
    echo
  done
else
  echo "(skipped: expanding fixtures/trained/compact.npz needs python3 with numpy)"
fi
