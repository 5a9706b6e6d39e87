#!/usr/bin/env bash
# The one test command (README): installs what the tests need, builds once, runs the Rust tests
# and the Python tests side by side, and prints the time of each part, of the slowest Rust test
# binaries and of the slowest Python tests. Exits non-zero on any failure.
#
# What it installs or downloads, each announced in its output before it happens:
# * `.venv/` inside the repository (git-ignored; scripts/venv.sh): a Python virtual environment
#   with scripts/requirements.txt (numpy, tiktoken, pytest, pytest-xdist, openai, openai-agents, anthropic,
#   jsonschema, prometheus-client) from PyPI; the system's Python is not touched. Delete `.venv/` to start
#   over.
# * nginx-light via apt-get, only if no nginx is installed (the load-balancer test's balancer).
# * Once per machine, outside the clone, in ~/.cache/k3/ ($K3_CACHE_DIR, else
#   $XDG_CACHE_HOME/k3; scripts/k3cache.py): the trained-proxy smoke test's pinned JAX
#   environment (scripts/requirements-train.txt from PyPI, about 630 MB) and its corpus (the
#   Django 5.1.4 sdist from PyPI, 10.7 MB, sha256-checked). Fetched in the background while cargo
#   builds; later runs, from any clone, reuse them.
# * `target/`: cargo's build (one build, `cargo test --no-run`, serves the tests and the
#   binaries in target/debug; about 180 crates the first time) and the generated test
#   checkpoints under target/k3-test-models/ (made once, shared by the Rust and Python tests).
#
# Where the time goes (2 cores): the build, then four streams at the same time (each waits on
# processes and I/O part of the time): two cargo test lanes (the end-to-end crate tests/, the rest), the
# trained-proxy smoke test (a ten-step training) and the other Python tests in three workers. At
# the end: each part's wall time and the CPU time its processes used, the slowest test binaries
# (one per crate: each crate's tests/ files are modules of one binary) and Python test files.
set -euo pipefail
cd "$(dirname "$0")/.."

T0=$SECONDS
LOGS=$(mktemp -d -t k3-test.XXXXXX)
PARTS=()
part() { # part NAME SECONDS [CPU-SECONDS]: remember a part's time for the summary
  PARTS+=("$(printf '  %-58s %5d s %7s' "$1" "$2" "${3:+$3 CPU-s}")")
}
child_cpu() { # child_cpu FILE: write the CPU time (user + system) of this shell's finished
  # children, in whole seconds, to FILE (`times` itself, not in a pipeline or `$(…)`: a subshell
  # has no children of its own). Processes that detach from their parent, such as a store
  # started with --detach, are not counted.
  times > "$1.times"
  awk 'NR == 2 { t = 0; for (i = 1; i <= 2; i++) { split($i, a, /[ms]/); t += a[1] * 60 + a[2] }
                 printf "%d\n", t }' "$1.times" > "$1"
  rm -f "$1.times"
}
summary() {
  echo
  echo "== time per part (wall, and the CPU time of its processes: 2 cores give 2 CPU-s a second)"
  printf '%s\n' "${PARTS[@]}"
  child_cpu "$LOGS/total.cpu"
  printf '  %-58s %5d s %7s\n' "total" $((SECONDS - T0)) "$(cat "$LOGS/total.cpu") CPU-s"
}
trap 'summary; rm -rf "$LOGS"' EXIT

# ---- installs -----------------------------------------------------------------------------------
t=$SECONDS
. scripts/venv.sh
if ! command -v nginx >/dev/null && [ ! -x /usr/sbin/nginx ]; then
  # Without it scripts/tests/test_load_balancer.py fails (never skips).
  echo "== installing nginx-light system-wide with apt-get (the load-balancer test's balancer; none is installed)"
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nginx-light; } \
    || echo "warning: cannot install nginx-light; the load-balancer test will fail" >&2
fi
part "installs: .venv/ (pip), nginx (apt-get, when missing)" $((SECONDS - t))

CACHE=$(python3 -c 'import sys; sys.path.insert(0, "scripts"); import k3cache; print(k3cache.root())')
echo "== in the background while cargo builds: the trained-proxy test's JAX environment and corpus in"
echo "   $CACHE (scripts/train_k3.py --setup; installs and downloads only what is not there yet:"
echo "   about 630 MB from PyPI once per machine); its log is printed when the build is done"
SETUP_T=$SECONDS
( rc=0; python3 scripts/train_k3.py --setup > "$LOGS/setup.log" 2>&1 || rc=$?
  echo $rc > "$LOGS/setup.rc"
  echo $((SECONDS - SETUP_T)) > "$LOGS/setup.secs"; child_cpu "$LOGS/setup.cpu" ) &
SETUP=$!

# ---- build once ---------------------------------------------------------------------------------
t=$SECONDS
echo "== building the tests and the binaries once (cargo test --workspace --no-run: target/debug/k3-*"
echo "   included; a first build compiles about 180 crates, cargo shows its progress)"
( cargo test --workspace --no-run
  # A no-op after the line above (the workspace keeps `cargo build`'s features those of `cargo
  # test`, Cargo.toml says how): it only makes sure, and says so if it ever is not.
  cargo build --workspace --bins 2>&1 | tee "$LOGS/build.log" | grep -v '^ *Finished' || true
  child_cpu "$LOGS/build.cpu" )
if grep -q Compiling "$LOGS/build.log"; then
  echo "warning: cargo build recompiled what cargo test built (features differ between the two)" >&2
fi
part "build (cargo test --no-run; cargo build: a no-op)" $((SECONDS - t)) "$(cat "$LOGS/build.cpu")"

wait "$SETUP" || true
echo "== the trained-proxy environment and corpus ($(cat "$LOGS/setup.secs") s, beside the build):"
sed 's/^/   /' "$LOGS/setup.log"
part "installs: JAX environment + corpus (beside the build)" "$(cat "$LOGS/setup.secs")" "$(cat "$LOGS/setup.cpu")"
if [ "$(cat "$LOGS/setup.rc")" != 0 ]; then
  echo "warning: the trained-proxy setup failed; scripts/tests/test_train_k3.py will fail" >&2
fi

# ---- tests: Rust and Python side by side --------------------------------------------------------
# Two pytest runs: the trained-proxy smoke test (ten steps of JAX training, then three forwards)
# and all the others, those in three pytest-xdist workers, a test file to a worker (most of
# their time is waiting: the two-minute chaos run, servers, child processes), so no file waits
# for another.
echo "== Python tests in the background (pytest scripts/tests/test_train_k3.py, and pytest -n 3"
echo "   scripts/tests without it: three workers, a file to each; $VIRTUAL_ENV/bin/python3); their"
echo "   output printed when they end"
PY_T=$SECONDS
# `|| rc=$?`: under `set -e` a failing pytest would end its subshell before its time is written.
( rc=0; python3 -m pytest -q -rs --durations=12 -p no:cacheprovider -n 3 --dist loadfile --no-loadscope-reorder \
    --junitxml="$LOGS/python.xml" --ignore=scripts/tests/test_train_k3.py scripts/tests \
    > "$LOGS/python.log" 2>&1 || rc=$?
  echo $((SECONDS - PY_T)) > "$LOGS/python.secs"; child_cpu "$LOGS/python.cpu"; exit $rc ) &
PY=$!
( rc=0; python3 -m pytest -q -rs --durations=3 -p no:cacheprovider scripts/tests/test_train_k3.py \
    > "$LOGS/train.log" 2>&1 || rc=$?
  echo $((SECONDS - PY_T)) > "$LOGS/train.secs"; child_cpu "$LOGS/train.cpu"; exit $rc ) &
TRAIN=$!

# Two cargo runs side by side (cargo runs one test binary at a time, and the end-to-end tests
# mostly wait on the processes they start): the end-to-end crate's test binary (tests/tests/,
# every file a module of `e2e`); and the libraries' and binaries' unit tests, every other crate's
# test binary (one per crate, and alloc.rs), then the doc tests. Both select the whole workspace
# and name their test binaries (from `cargo metadata`), so both use the one build above (`-p
# k3-tests` would unify other features and build again).
LANES=$(cargo metadata --format-version 1 --no-deps | python3 -c '
import json, sys
pk = json.load(sys.stdin)["packages"]
names = lambda p: [t["name"] for t in p["targets"] if "test" in t["kind"]]
e2e = [n for p in pk if p["name"] == "k3-tests" for n in names(p)]
other = sorted({n for p in pk if p["name"] != "k3-tests" for n in names(p)})
if not e2e or set(e2e) & set(other):
    sys.exit(f"the end-to-end test binaries must be named unlike any other crate'"'"'s: {e2e}, {other}")
print(" ".join(e2e)); print(" ".join(other))')
E2E=(); OTHER=()
for name in $(sed -n 1p <<< "$LANES"); do E2E+=(--test "$name"); done
for name in $(sed -n 2p <<< "$LANES"); do OTHER+=(--test "$name"); done
echo "== Rust tests in two lanes (every test binary runs; failures listed at the end of each):"
echo "   end to end (cargo test --workspace --no-fail-fast ${E2E[*]}: tests/tests/, in the background, its"
echo "   output printed when it ends), and the rest (cargo test --workspace --no-fail-fast --lib --bins"
echo "   ${OTHER[*]}; then --doc)"
t=$SECONDS
( rc=0; cargo test --workspace --no-fail-fast "${E2E[@]}" 2>&1 | python3 scripts/test_times.py --slowest 10 \
    > "$LOGS/rust-e2e.log" || rc=$?
  echo $((SECONDS - t)) > "$LOGS/rust-e2e.secs"; child_cpu "$LOGS/rust-e2e.cpu"; exit $rc ) &
RUST_E2E=$!
rust_rc=0
( rc=0; cargo test --workspace --no-fail-fast --lib --bins "${OTHER[@]}" 2>&1 || rc=$?
  cargo test --workspace --no-fail-fast --doc 2>&1 || rc=$?; child_cpu "$LOGS/rust.cpu"; exit $rc ) \
  | python3 scripts/test_times.py --slowest 10 || rust_rc=$?
part "Rust tests: the workspace's own (beside the others)" $((SECONDS - t)) "$(cat "$LOGS/rust.cpu")"
wait "$RUST_E2E" || rust_rc=$((rust_rc | $?))
echo "== Rust end-to-end tests (tests/tests/): output"
cat "$LOGS/rust-e2e.log"
part "Rust tests: end to end, tests/ (beside the others)" "$(cat "$LOGS/rust-e2e.secs")" "$(cat "$LOGS/rust-e2e.cpu")"

# Each stream's exit status is its pytest's, taken from `wait` (a status file could be read
# before it is written).
py_rc=0
wait "$PY" || py_rc=$?
train_rc=0
wait "$TRAIN" || train_rc=$?
echo
echo "== Python tests: output"
cat "$LOGS/python.log"
if [ -s "$LOGS/python.xml" ]; then
  python3 scripts/test_times.py --junit "$LOGS/python.xml" --slowest 12 || true
fi
echo "== the trained-proxy smoke test (scripts/tests/test_train_k3.py): output"
cat "$LOGS/train.log"
part "Python tests (pytest -n 3 scripts/tests; beside the Rust tests)" "$(cat "$LOGS/python.secs")" "$(cat "$LOGS/python.cpu")"
part "Python: the trained-proxy smoke test (beside the others)" "$(cat "$LOGS/train.secs")" "$(cat "$LOGS/train.cpu")"

if [ "$rust_rc" != 0 ] || [ "$py_rc" != 0 ] || [ "$train_rc" != 0 ]; then
  echo "== FAILED: Rust tests exit $rust_rc, Python tests exit $py_rc, trained-proxy test exit $train_rc" >&2
  exit 1
fi
echo "== all tests passed"
