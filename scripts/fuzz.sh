#!/usr/bin/env bash
# Fuzz every parser target in fuzz/ for SECONDS each (default 10) on its seed corpus
# (fuzz/corpus/<target>); exit 1 on any crash, panic, leak, allocation over the limit or
# timeout, with the reproducer saved under fuzz/artifacts/<target>/.
#
#   scripts/fuzz.sh [SECONDS] [TARGET...]
#
# Installs what it needs: the nightly toolchain (if rustup has none) and cargo-fuzz (if
# `cargo fuzz` is missing). New corpus entries go to a scratch directory, so the committed
# seed corpus stays as fuzz/gen_corpus.sh wrote it. Limits per input: 10 s (hang), 2 GB RSS,
# one allocation of at most 256 MB (the inputs are at most a few hundred KB; every parser bounds
# its lengths before allocating). Targets run one at a time, one process each.
# See docs/RELIABILITY.md "Fuzzing".
set -euo pipefail

secs="${1:-10}"
[[ $secs =~ ^[0-9]+$ && $secs -gt 0 ]] || { echo "usage: $0 [SECONDS] [TARGET...]" >&2; exit 2; }
shift $(( $# > 0 ? 1 : 0 ))
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"

if ! rustup toolchain list | grep -q '^nightly'; then
    echo "fuzz: installing the nightly toolchain"
    rustup toolchain install nightly --profile minimal
fi
if ! cargo fuzz --version >/dev/null 2>&1; then
    echo "fuzz: installing cargo-fuzz"
    cargo install cargo-fuzz --locked
fi

if (( $# > 0 )); then
    targets=("$@")
else
    mapfile -t targets < <(cargo +nightly fuzz list)
fi

echo "fuzz: building ${#targets[@]} targets (nightly, AddressSanitizer, debug assertions)"
cargo +nightly fuzz build

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
export K3_FUZZ_TMP="$work/tmp"
mkdir -p "$K3_FUZZ_TMP"

failed=()
for t in "${targets[@]}"; do
    [[ -d fuzz/corpus/$t ]] || { echo "fuzz: no seed corpus fuzz/corpus/$t (run fuzz/gen_corpus.sh)" >&2; exit 2; }
    mkdir -p "$work/corpus/$t" "fuzz/artifacts/$t"
    log="$work/$t.log"
    if cargo +nightly fuzz run "$t" "$work/corpus/$t" "fuzz/corpus/$t" -- \
        -max_total_time="$secs" -timeout=10 -rss_limit_mb=2048 -malloc_limit_mb=256 \
        -print_final_stats=1 -artifact_prefix="fuzz/artifacts/$t/" >"$log" 2>&1; then
        runs="$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)"
        speed="$(sed -n 's/^stat::average_exec_per_sec: *//p' "$log" | tail -1)"
        corpus="$(ls "$work/corpus/$t" | wc -l)"
        printf 'fuzz: %-20s ok   %9s runs  %6s exec/s  %5s new corpus entries\n' \
            "$t" "${runs:-?}" "${speed:-?}" "$corpus"
    else
        echo "fuzz: $t FAILED; last lines of its log:"
        grep -v '^#[0-9]' "$log" | tail -40
        failed+=("$t")
    fi
done
rm -rf "$K3_FUZZ_TMP"

if (( ${#failed[@]} > 0 )); then
    echo "fuzz: ${#failed[@]} of ${#targets[@]} targets failed: ${failed[*]} (reproducers in fuzz/artifacts/)"
    exit 1
fi
echo "fuzz: ${#targets[@]} passed, 0 failed"
