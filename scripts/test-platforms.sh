#!/usr/bin/env bash
# The other platforms (README "Platforms"): lints the whole workspace for macOS on Apple silicon
# (compiled and linted here, never run), and cross-builds the aarch64 Linux tests and runs them
# under user-mode emulation: the kernels (the NEON tier against its bit-exact model), the tiny
# model against the float64 reference's ids, the tokenizer and the rest of the engine's unit
# tests, and the store's tests (k3-store's own, default paths). Exits non-zero on any failure;
# prints how long each part took.
#
# What it installs, each announced before it happens:
# * the Rust standard libraries for aarch64-unknown-linux-gnu and aarch64-apple-darwin
#   (`rustup target add`; into the rustup toolchain, not the repository);
# * with apt-get, system-wide, only what is missing: gcc-aarch64-linux-gnu (the cross linker),
#   libc6-dev-arm64-cross (the aarch64 C library it links against) and qemu-user
#   (qemu-aarch64, the emulator the tests run under).
# * `target/aarch64-*`: cargo's builds for those targets (a first build takes ~10 minutes on 2
#   cores).
#
# Usage: scripts/test-platforms.sh [--no-install]   (--no-install: fail instead of installing)
# Takes about 25 minutes on 2 cores from a clean target/ (most of it the aarch64 test build).
set -euo pipefail
cd "$(dirname "$0")/.."

install=1
[ "${1:-}" = "--no-install" ] && install=0

t0=$(date +%s)
part_start=$t0
part() {
  local now
  now=$(date +%s)
  echo "== [platforms] $1 took $((now - part_start)) s"
  part_start=$now
}

for t in aarch64-unknown-linux-gnu aarch64-apple-darwin; do
  if ! rustup target list --installed | grep -qx "$t"; then
    [ $install = 1 ] || { echo "missing Rust target $t" >&2; exit 1; }
    echo "== installing the Rust standard library for $t (rustup target add $t)"
    rustup target add "$t"
  fi
done
missing=()
command -v aarch64-linux-gnu-gcc >/dev/null || missing+=(gcc-aarch64-linux-gnu)
[ -e /usr/aarch64-linux-gnu/lib/libc.so.6 ] || missing+=(libc6-dev-arm64-cross)
command -v qemu-aarch64 >/dev/null || missing+=(qemu-user)
if [ ${#missing[@]} -gt 0 ]; then
  [ $install = 1 ] || { echo "missing Debian packages: ${missing[*]}" >&2; exit 1; }
  echo "== installing ${missing[*]} system-wide with apt-get (aarch64 cross linker, C library and user-mode emulator)"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}"
fi
part "installs"

echo "== macOS (aarch64-apple-darwin): cargo clippy --workspace --all-targets -- -D warnings"
cargo clippy --workspace --all-targets --target aarch64-apple-darwin -- -D warnings
part "macOS clippy"

# Cross linker and emulator for the aarch64 Linux tests (environment, not .cargo/config.toml:
# on a native aarch64 machine cargo must use its own linker and run the tests directly).
runner="qemu-aarch64 -L /usr/aarch64-linux-gnu"
export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER=aarch64-linux-gnu-gcc
export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUNNER="$runner"
# Tests that run their own binary again go through the emulator too (an emulated process cannot
# exec an aarch64 binary without the kernel's binfmt registration).
export K3_TEST_RUNNER="$runner"
arm=(--target aarch64-unknown-linux-gnu)

# (No separate aarch64 Linux clippy: the macOS lint above already covers the aarch64 code, the
# x86-64 lint in .ci/run the Linux code.)

# The engine's tests that run in-process: the library's, alloc.rs, and the modules of the
# worker_suite binary below (not cli::, which runs the built binaries: x86-64 only; not spec::,
# speculative decoding, 6 minutes under emulation, no platform code; nor the tokenizer-heavy
# constrain::, shaping:: and tools::, which test no platform code either).
worker=(-p k3-worker --lib --test worker_suite --test alloc)
suite_skips=(--skip cli:: --skip spec:: --skip constrain:: --skip shaping:: --skip tools::)

echo "== aarch64 Linux: building the tests (cargo shows its progress)"
cargo test --no-run "${arm[@]}" -p k3-proto -p k3-store
cargo test --no-run "${arm[@]}" "${worker[@]}"
part "aarch64 Linux test build"

echo "== aarch64 Linux under $runner: proto and store (unit and integration tests)"
cargo test "${arm[@]}" -p k3-proto -p k3-store
part "aarch64 Linux store tests under emulation"
echo "== aarch64 Linux under $runner: engine (every kernel tier against the scalar reference and"
echo "   its bit-exact model, the tokenizer, the tiny model against the float64 reference's ids)"
# (chat.rs's refusal test runs the built k3-worker binary, which an emulated process cannot
# exec; it runs on x86-64 in scripts/test.sh.)
cargo test "${arm[@]}" -p k3-worker --lib --test alloc
cargo test "${arm[@]}" -p k3-worker --test worker_suite -- "${suite_skips[@]}" \
  --skip chat_flags_are_refused_before_any_work
part "aarch64 Linux engine tests under emulation"

echo "== [platforms] all parts took $(($(date +%s) - t0)) s"
