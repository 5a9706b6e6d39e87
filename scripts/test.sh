#!/usr/bin/env bash
# The one test command (README): installs what the tests need, builds every binary, runs the Rust
# tests and the Python reference/tokenizer tests. Exits non-zero on any failure.
#
# What it changes on this machine, each announced before it happens:
# * `.venv/` inside the repository (git-ignored): a Python virtual environment with
#   scripts/requirements.txt (numpy, tiktoken, pytest, openai, anthropic, jsonschema,
#   prometheus-client); the system's Python is not touched. Delete `.venv/` to start over.
# * nginx-light via apt-get, only if no nginx is installed (the load-balancer test's balancer).
# * `target/`: cargo's build (a first debug build takes several minutes on 2 cores).
set -euo pipefail
cd "$(dirname "$0")/.."

. scripts/venv.sh

if ! command -v nginx >/dev/null && [ ! -x /usr/sbin/nginx ]; then
  # Without it scripts/tests/test_load_balancer.py fails (never skips).
  echo "== installing nginx-light system-wide with apt-get (the load-balancer test's balancer; none is installed)"
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nginx-light; } \
    || echo "warning: cannot install nginx-light; the load-balancer test will fail" >&2
fi

echo "== building every binary into target/debug (cargo build --workspace --bins; cargo shows its progress)"
cargo build --workspace --bins

echo "== Rust tests"
cargo test --workspace

echo "== Python tests (reference forward, generator, tokenizer parity, serve) with $VIRTUAL_ENV/bin/python3"
python3 -m pytest -q scripts/tests
