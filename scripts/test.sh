#!/usr/bin/env bash
# The one test command (README): installs what the tests need, builds every binary, runs the Rust
# tests and the Python reference/tokenizer tests. Exits non-zero on any failure.
set -euo pipefail
cd "$(dirname "$0")/.."

echo "== installing Python test dependencies (numpy, tiktoken, pytest)"
python3 -m pip install --quiet --disable-pip-version-check -r scripts/requirements.txt

echo "== installing nginx (the load-balancer test's balancer) if missing"
if ! command -v nginx >/dev/null && [ ! -x /usr/sbin/nginx ]; then
  # Without it scripts/tests/test_load_balancer.py fails (never skips).
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nginx-light; } \
    || echo "warning: cannot install nginx-light; the load-balancer test will fail" >&2
fi

echo "== building every binary"
cargo build --workspace --bins

echo "== Rust tests"
cargo test --workspace

echo "== Python tests (reference forward, generator, tokenizer parity)"
python3 -m pytest -q scripts/tests
