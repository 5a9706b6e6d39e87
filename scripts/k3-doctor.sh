#!/usr/bin/env bash
# k3-doctor.sh: thin wrapper over `k3-ctl doctor` (CPU, SIMD tiers, RAM -> recommended preset,
# disk bandwidth measured the way the engine reads). Builds k3-ctl (release) if needed.
#
#   scripts/k3-doctor.sh [--dir PATH] [--json] [--seconds N] [--size-mib N] [--no-disk]
#
# --dir: where the checkpoint lives (a scratch file is written there and deleted) or a checkpoint
# shard to read in place. Exit status is k3-ctl's.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x target/release/k3-ctl ] || [ -n "$(find k3-ctl/src k3-store/src -newer target/release/k3-ctl -name '*.rs' -print -quit)" ]; then
  echo "== building k3-ctl (release) into target/release (cargo shows its progress)" >&2
  cargo build --release -p k3-ctl >&2
fi
exec target/release/k3-ctl doctor "$@"
