#!/usr/bin/env bash
# k3 demo on the bundled tiny model (fixtures/tiny/model): pack its trunk, start a store, run two
# workers against it, show the warm cache in `k3-ctl stats`, stop the store.
#
#   scripts/demo.sh            # builds (debug profile, target/debug) and runs; everything else
#                              # lives in a temp dir, removed at the end
#   scripts/demo.sh --store-only   # the same without the trained proxy's part (its text)
#
# What it changes on this machine, each announced before it happens: `.venv/` inside the
# repository (scripts/venv.sh: the Python packages of scripts/requirements.txt, when missing) and
# cargo's `target/`. Python runs in that venv, never the system's.
#
# Exit status is non-zero if any step fails, with a line saying what was expected and what was
# seen. The two workers must print identical ids; the second one's TRUE resident hit rate is 100%
# because the first one's experts are still in the store, and it reads no trunk bytes and no
# expert on demand (the only reads it may make are the router lookahead's predictions).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
STORE_ONLY=0
case "${1:-}" in
  "") ;;
  --store-only) STORE_ONLY=1 ;;
  *) echo "usage: scripts/demo.sh [--store-only]" >&2; exit 2 ;;
esac

. scripts/venv.sh

echo "== building k3-store, k3-worker, k3-ctl into target/debug (cargo build --workspace --bins;"
echo "   a first build compiles about 160 crates: minutes on 2 cores; cargo shows its progress)"
cargo build --workspace --bins
BIN="$ROOT/target/debug"

WORK=$(mktemp -d -t k3-demo.XXXXXX)
SOCK="$WORK/run/store.sock"
cleanup() {
  if [ -S "$SOCK" ]; then "$BIN/k3-ctl" stop --socket "$SOCK" >/dev/null 2>&1 || true; fi
  rm -rf "$WORK"
}
trap cleanup EXIT
fail() { # fail WHAT LOG: say which step failed, show its log, stop
  echo "demo FAILED: $1 exited non-zero; its log:" >&2
  cat "$2" >&2
  exit 1
}

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
    2> "$WORK/worker$1.err" | tee "$WORK/worker$1.out" || fail "worker $1" "$WORK/worker$1.err"
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
    la = r["lookahead"]
    print(f"{n}: ids {r['generated_ids']}  TRUE resident hit rate {100*r['true_resident_hit_rate']:.1f}%"
          f"  expert bytes read {r['expert_bytes_read']} (of them router-lookahead prefetches "
          f"{la['prefetched_bytes']}: {la['prefetched_experts']} experts, {la['used_experts']} then used)"
          f"  trunk bytes read {r['trunk_bytes_read']}")

failures = []
def check(ok, expected, saw):
    if not ok:
        failures.append(f"expected {expected}; saw {saw}")

check(a["generated_ids"] == b["generated_ids"], "both workers to give the same ids",
      f"worker 1 {a['generated_ids']}, worker 2 {b['generated_ids']}")
check(b["true_resident_hit_rate"] == 1.0,
      "worker 2 to find every expert its tokens route to resident (TRUE resident hit rate 100%)",
      f"{100*b['true_resident_hit_rate']:.1f}% ({b['resident_hits']} of {b['expert_requests']} requests)")
for n, r in (("worker 1", a), ("worker 2", b)):
    check(r["trunk_bytes_read"] == 0, f"{n} to read no trunk bytes (every layer is pinned in the store)",
          f"{r['trunk_bytes_read']} bytes")
# What worker 2 may still read: the router lookahead (K3_LOOKAHEAD, README "Environment"), while
# a layer computes, sends the store the experts it PREDICTS for the next layer, and the store
# reads those ahead into free slots. A prediction can name an expert no token then routes to.
# Prefetches are best effort: a job's prediction the store has not started when that job's next
# one arrives is skipped (k3-store daemon/backend.rs, `prefetch`). So which predicted experts
# worker 1 had read depends on timing (a busy machine skips more), and worker 2, predicting the
# same or, drafting from the store's history of worker 1, in other passes, may read a predicted
# expert worker 1 skipped. Such reads are prefetches, never demands: worker 2 waits for none.
demand = b["expert_bytes_read"] - b["lookahead"]["prefetched_bytes"]
check(demand == 0, "worker 2's only expert reads to be router-lookahead prefetches (no demand read)",
      f"{b['expert_bytes_read']} bytes read, {b['lookahead']['prefetched_bytes']} of them prefetched")
if failures:
    print("\ndemo FAILED:", *failures, sep="\n  ", file=sys.stderr)
    sys.exit(1)
extra, used = b["lookahead"]["prefetched_experts"], b["lookahead"]["used_experts"]
print("identical ids; the second worker found every expert its tokens routed to resident (TRUE hit "
      "rate 100%) and never waited for a read"
      + (f" (its router lookahead read {extra} predicted expert(s) ahead, {used} of them then used)"
         if extra else ", reading no bytes from disk")
      + f"; all {n_layers} trunk layers are pinned in the store's shared memory, so neither worker "
      f"read the {trunk_mb:.2f} MB of trunk that a standalone run reads")
PY

echo
echo "== stopping the store"
"$BIN/k3-ctl" stop --socket "$SOCK"
if [ -e "$SOCK" ]; then
  echo "demo FAILED: expected k3-ctl stop to remove the socket $SOCK; it is still there" >&2
  exit 1
fi
echo "socket removed; shared memory (a memfd) went with the process"

# ---- the trained proxy (issue #31) ------------------------------------------------------------
if [ "$STORE_ONLY" = 1 ]; then
  exit 0
fi
echo
echo "== the trained proxy: K3's tensor graph trained here on Django's documentation and source"
echo "   (fixtures/trained/compact.npz expanded to a 180 MB K3 checkpoint; scripts/train_k3.py)"
python3 scripts/train_k3.py "$WORK/trained" --expand fixtures/trained/compact.npz
for prompt in "To create a new Django project, run" "from django.db import models"; do
  echo "-- prompt: $prompt"
  "$BIN/k3-worker" --standalone "$WORK/trained" --tok fixtures/tokenizer --prompt "$prompt" \
    --gen 48 2> "$WORK/trained.err" || fail "the trained proxy's worker" "$WORK/trained.err"
  echo
done
