#!/usr/bin/env bash
# The one test command (README): installs what the tests need, builds once, runs the Rust tests
# and the Python tests side by side, and prints the time of each part, of the slowest Rust test
# binaries and of the slowest Python tests. Exits non-zero on any failure.
#
# What it installs or downloads, each announced in its output before it happens (all three in the
# background while cargo builds the binaries, which needs none of them):
# * `.venv/` inside the repository (git-ignored; scripts/venv.sh): a Python virtual environment
#   with scripts/requirements.txt (numpy, tiktoken, pytest, pytest-xdist, openai, openai-agents, anthropic,
#   jsonschema, prometheus-client) from PyPI; the system's Python is not touched. Delete `.venv/` to start
#   over.
# * nginx-light via apt-get, only if no nginx is installed (the load-balancer test's balancer).
# * Once per machine, outside the clone, in ~/.cache/k3/ ($K3_CACHE_DIR, else
#   $XDG_CACHE_HOME/k3; scripts/k3cache.py): the trained-proxy smoke test's pinned JAX
#   environment (scripts/requirements-train.txt from PyPI, about 630 MB) and its corpus (the
#   Django 5.1.4 sdist from PyPI, 10.7 MB, sha256-checked). Later runs, from any clone, reuse them.
# * `target/`: cargo's build (one build: `cargo build --bins`, then `cargo test --no-run` adds the
#   test binaries to the same libraries; about 180 crates the first time) and the generated test
#   checkpoints under target/k3-test-models/ (made once, shared by the Rust and Python tests).
#
# Where the time goes (2 cores): the build is CPU-bound on both cores; most tests wait on the
# processes they start. So the binaries are built first, with the installs and the trained-proxy
# test's ten-step training (low priority) beside them; then the Python tests (five workers) and
# the trained-proxy test start at once, beside the build of the Rust test binaries: the
# end-to-end binary first, which then runs (four tests at a time) beside the build of the
# others, and then the other Rust tests. At
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
killtree() { # killtree PID: end a background stream and every process under it
  local c
  for c in $(ps -o pid= --ppid "$1" 2>/dev/null); do killtree "$c"; done
  kill "$1" 2>/dev/null || true
}
# On an early exit (a failed build) the streams started in the background (pip, the smoke training,
# tests) are ended too, not left running; after a whole run none is left.
trap 'summary; for j in $(jobs -p); do killtree "$j"; done; rm -rf "$LOGS"' EXIT

# ---- installs, in the background from the start ----------------------------------------------
# None of them is needed by the build: they run beside it, each logged. The logs of .venv/ and
# nginx are printed when the binaries are built (the Python tests are the first to need them),
# those of the JAX setup and training with the trained-proxy test's output at the end.
CACHE=$(python3 -c 'import sys; sys.path.insert(0, "scripts"); import k3cache; print(k3cache.root())')
echo "== in the background while cargo builds (their output printed later: .venv/ and nginx once the"
echo "   binaries are built, the JAX setup and training with the trained-proxy test's output):"
echo "   * .venv/ inside the repository (scripts/venv.sh: python3 -m venv when missing, then pip installs"
echo "     scripts/requirements.txt from PyPI when the venv lacks it: $(grep -v '^#' scripts/requirements.txt | tr '\n' ' ')"
echo "     with their dependencies; nothing goes into the system's Python)"
echo "   * the trained-proxy test's JAX environment and corpus in $CACHE (scripts/train_k3.py --setup:"
echo "     installs and downloads only what is not there yet, about 630 MB from PyPI once per machine),"
echo "     then that test's ten-step training (scripts/train_k3.py OUT --smoke, at a lower priority: it"
echo "     needs no binary); the test itself (scripts/tests/test_train_k3.py) once the binaries are built"
if ! command -v nginx >/dev/null && [ ! -x /usr/sbin/nginx ]; then
  # Without it scripts/tests/test_load_balancer.py fails (never skips).
  echo "   * nginx-light, system-wide, with apt-get (the load-balancer test's balancer; no nginx is installed)"
  NGINX_T=$SECONDS
  ( rc=0; { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nginx-light; } \
      > "$LOGS/nginx.log" 2>&1 || rc=$?
    [ $rc = 0 ] || echo "warning: cannot install nginx-light; the load-balancer test will fail" >> "$LOGS/nginx.log"
    echo $((SECONDS - NGINX_T)) > "$LOGS/nginx.secs"; child_cpu "$LOGS/nginx.cpu" ) &
  NGINX=$!
fi
BG_T=$SECONDS
# `|| rc=$?`: under `set -e` a failing step would end its subshell before its time is written.
( rc=0; . scripts/venv.sh > "$LOGS/venv.log" 2>&1 || rc=$?
  echo $rc > "$LOGS/venv.rc"; echo $((SECONDS - BG_T)) > "$LOGS/venv.secs"; child_cpu "$LOGS/venv.cpu" ) &
VENV=$!
# The trained-proxy smoke test's stream: the JAX setup, its ten-step training (which needs no
# binary, so it runs beside the build, taking what CPU the build leaves), then, once the
# binaries and .venv/ are ready ($LOGS/bins.done), the test on that training (K3_TRAIN_SMOKE).
SMOKE="$LOGS/smoke/model"
( rc=0; python3 scripts/train_k3.py --setup > "$LOGS/setup.log" 2>&1 || rc=$?
  echo $((SECONDS - BG_T)) > "$LOGS/setup.secs"
  if [ $rc = 0 ]; then
    nice -n 10 python3 scripts/train_k3.py "$SMOKE" --smoke > "$LOGS/smoke.log" 2>&1 || rc=$?
  fi
  echo $((SECONDS - BG_T)) > "$LOGS/smoke.secs"
  while [ ! -e "$LOGS/bins.done" ]; do kill -0 $$ 2>/dev/null || exit 1; sleep 1; done
  if [ $rc = 0 ]; then
    . scripts/venv.sh > /dev/null
    K3_TRAIN_SMOKE="$SMOKE" nice -n 10 python3 -m pytest -q -rs --durations=3 -p no:cacheprovider \
      scripts/tests/test_train_k3.py > "$LOGS/train.log" 2>&1 || rc=$?
  else
    echo "the setup or the smoke training failed (its output above): the test did not run" > "$LOGS/train.log"
  fi
  echo $((SECONDS - BG_T)) > "$LOGS/train.secs"; child_cpu "$LOGS/train.cpu"; exit $rc ) &
TRAIN=$!

# ---- build the binaries -------------------------------------------------------------------------
t=$SECONDS
echo "== building the binaries (cargo build --workspace --bins: target/debug/k3-*; a first build"
echo "   compiles about 180 crates, cargo shows its progress)"
( cargo build --workspace --bins; child_cpu "$LOGS/build.cpu" )
part "build: the binaries (cargo build --workspace --bins)" $((SECONDS - t)) "$(cat "$LOGS/build.cpu")"

wait "$VENV" || true
echo "== .venv/ ($(cat "$LOGS/venv.secs") s, beside the build):"
sed 's/^/   /' "$LOGS/venv.log"
part "installs: .venv/ (pip; beside the build)" "$(cat "$LOGS/venv.secs")" "$(cat "$LOGS/venv.cpu")"
if [ "$(cat "$LOGS/venv.rc")" != 0 ]; then
  echo "== FAILED: scripts/venv.sh could not make .venv/ (its output above)" >&2
  exit 1
fi
. scripts/venv.sh > /dev/null
if [ -n "${NGINX:-}" ]; then
  wait "$NGINX" || true
  echo "== nginx-light ($(cat "$LOGS/nginx.secs") s, beside the build):"
  sed 's/^/   /' "$LOGS/nginx.log"
  part "installs: nginx-light (apt-get; beside the build)" "$(cat "$LOGS/nginx.secs")" "$(cat "$LOGS/nginx.cpu")"
fi
# ---- tests: the Python tests start now, beside the build of the Rust test binaries ------------
# Two pytest runs: the trained-proxy smoke test (its stream, started above, runs it on its
# training once bins.done exists: three forwards that must agree) and all the others, those in
# five pytest-xdist workers, a test file to a worker (most of their time is waiting: the
# two-minute chaos run, servers, child processes), so no file waits for another. They use the
# binaries just built (target/debug); `K3_CTL` spares the tokenizer test its own `cargo build`,
# which would wait on the lock of the build below.
PY_WORKERS=5
echo "== Python tests in the background (pytest -n $PY_WORKERS scripts/tests without test_train_k3.py: $PY_WORKERS"
echo "   workers, a file to each; $VIRTUAL_ENV/bin/python3), and the trained-proxy test on its training;"
echo "   their output printed when they end"
export K3_CTL="$PWD/target/debug/k3-ctl"
PY_T=$SECONDS
( rc=0; python3 -m pytest -q -rs --durations=12 -p no:cacheprovider -n "$PY_WORKERS" --dist loadfile \
    --no-loadscope-reorder --junitxml="$LOGS/python.xml" --ignore=scripts/tests/test_train_k3.py scripts/tests \
    > "$LOGS/python.log" 2>&1 || rc=$?
  echo $((SECONDS - PY_T)) > "$LOGS/python.secs"; child_cpu "$LOGS/python.cpu"; exit $rc ) &
PY=$!
touch "$LOGS/bins.done"  # the trained-proxy test's stream starts its test

# The Rust test binaries: the end-to-end crate's (tests/tests/, every file a module of one binary)
# first, started at once beside the build of the others. It runs as cargo would run it (from its
# package's directory), but directly, and takes the binaries from K3_BIN_DIR (tests/src/lib.rs),
# since a `cargo` would wait for the build's lock. Its tests mostly wait on the processes they
# start, so it runs four at a time. Both builds select the whole workspace and name their test
# binaries (from `cargo metadata`), so they reuse the build above (`-p k3-tests` would unify
# other features and build again).
LANES=$(cargo metadata --format-version 1 --no-deps | python3 -c '
import json, sys
pk = json.load(sys.stdin)["packages"]
names = lambda p: [t["name"] for t in p["targets"] if "test" in t["kind"]]
e2e = [n for p in pk if p["name"] == "k3-tests" for n in names(p)]
other = sorted({n for p in pk if p["name"] != "k3-tests" for n in names(p)})
if len(e2e) != 1 or set(e2e) & set(other):
    sys.exit(f"the end-to-end crate must have one test binary, named unlike any other crate'"'"'s: {e2e}, {other}")
print(" ".join(e2e)); print(" ".join(other))')
E2E_NAME=$(sed -n 1p <<< "$LANES")
OTHER=()
for name in $(sed -n 2p <<< "$LANES"); do OTHER+=(--test "$name"); done
t=$SECONDS
echo "== building the end-to-end test binary (cargo test --workspace --no-run --test $E2E_NAME)"
E2E_BIN=$( (cargo test --workspace --no-run --test "$E2E_NAME" --message-format=json-render-diagnostics \
            ; child_cpu "$LOGS/build-e2e.cpu") | python3 -c '
import json, sys
exe = [m["executable"] for m in map(json.loads, sys.stdin) if m.get("reason") == "compiler-artifact"
       and m.get("executable") and m["target"]["name"] == sys.argv[1] and m["profile"]["test"]]
if len(exe) != 1:
    sys.exit(f"cargo reported {len(exe)} executables for the test binary {sys.argv[1]}")
print(exe[0])' "$E2E_NAME")
part "build: the end-to-end test binary (beside the Python tests)" $((SECONDS - t)) "$(cat "$LOGS/build-e2e.cpu")"
E2E_THREADS=4
echo "== Rust end-to-end tests in the background ($E2E_BIN --test-threads $E2E_THREADS, from tests/;"
echo "   K3_BIN_DIR=target/debug): output printed when they end"
t_e2e=$SECONDS
( rc=0; cd tests && K3_BIN_DIR="$OLDPWD/target/debug" "$E2E_BIN" --test-threads "$E2E_THREADS" \
    > "$LOGS/rust-e2e.log" 2>&1 || rc=$?
  echo $((SECONDS - t_e2e)) > "$LOGS/rust-e2e.secs"; child_cpu "$LOGS/rust-e2e.cpu"; exit $rc ) &
RUST_E2E=$!

t=$SECONDS
echo "== building the other test binaries (cargo test --workspace --no-run: the libraries' and binaries'"
echo "   unit tests, ${OTHER[*]})"
( cargo test --workspace --no-run; child_cpu "$LOGS/build-tests.cpu" )
part "build: the other test binaries (beside the tests)" $((SECONDS - t)) "$(cat "$LOGS/build-tests.cpu")"

echo "== Rust tests: the workspace's own (cargo test --workspace --no-fail-fast --lib --bins ${OTHER[*]};"
echo "   then --doc; the end-to-end tests run beside them)"
t=$SECONDS
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
echo "== the trained-proxy environment and corpus (scripts/train_k3.py --setup): output"
sed 's/^/   /' "$LOGS/setup.log"
echo "== the trained-proxy smoke training (scripts/train_k3.py OUT --smoke): the end of its output"
tail -n 12 "$LOGS/smoke.log" | sed 's/^/   /'
echo "== the trained-proxy smoke test (scripts/tests/test_train_k3.py): output"
cat "$LOGS/train.log"
part "Python tests (pytest -n $PY_WORKERS scripts/tests; beside the Rust tests)" "$(cat "$LOGS/python.secs")" "$(cat "$LOGS/python.cpu")"
part "installs: JAX environment + corpus (from the start)" "$(cat "$LOGS/setup.secs")"
part "Python: the trained-proxy smoke training (ends at, from the start)" "$(cat "$LOGS/smoke.secs")"
part "Python: the trained-proxy smoke test (ends at, from the start; CPU: all three)" "$(cat "$LOGS/train.secs")" "$(cat "$LOGS/train.cpu")"

if [ "$rust_rc" != 0 ] || [ "$py_rc" != 0 ] || [ "$train_rc" != 0 ]; then
  echo "== FAILED: Rust tests exit $rust_rc, Python tests exit $py_rc, trained-proxy test exit $train_rc" >&2
  exit 1
fi
echo "== all tests passed"
