#!/usr/bin/env bash
# Runs the unit tests of k3's unsafe owner types that need no system calls under Miri
# (undefined-behaviour checker; issue 13 item 5):
#   k3-store  arena::             ArenaMem's checked guards (read/write) and the placement rule
#             experts::tests::slot_views_are_disjoint_and_inside_the_arena
#                                 the routed-expert slot views (Arena::heap / Arena::over)
#             experts::tests::table_lru_order_and_explicit_holders   the slot state machine
#   k3-worker --test worker_suite, its kernels:: tests:
#                                 bf16 widening (all 65536 patterns, slice and scalar), the
#                                 dot product's tails (lengths 0..4099), mxfp4 single columns,
#                                 degenerate shapes and the length checks. Miri reports no CPU
#                                 features, so only the scalar tier runs (the SIMD tiers' loads
#                                 are not covered). Matrix tests large enough for the rayon path
#                                 are left out: too slow interpreted (the 37x1001 one ran > 12
#                                 min), and rayon's crossbeam-epoch breaks Stacked Borrows
#                                 (crossbeam-rs/crossbeam#545, #996), so the kernels run under
#                                 -Zmiri-tree-borrows; the store tests use Stacked Borrows.
#                                 -Zmiri-deterministic-floats: by default Miri adds random
#                                 ULP errors to powi & co., which the tests' f64 oracles use
#                                 (2f64.powi(-127) came out one ULP off).
# Tests that need system calls Miri lacks (O_DIRECT, memfd, file mappings) are not selected;
# those in the selected modules carry #[cfg_attr(miri, ignore)].
#
#   scripts/miri.sh          (needs the nightly toolchain with the miri component)
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"

if ! cargo +nightly miri --version >/dev/null 2>&1; then
    echo "miri: installing the miri component for nightly"
    rustup toolchain list | grep -q '^nightly' || rustup toolchain install nightly --profile minimal
    rustup component add --toolchain nightly miri rust-src
fi
cargo +nightly miri setup >/dev/null

start=$SECONDS
step() { echo "miri: $*"; }

step "k3-store: arena slicing, expert slot views, slot table"
cargo +nightly miri test -p k3-store --lib -- \
    arena:: experts::tests::slot_views_are_disjoint_and_inside_the_arena \
    experts::tests::table_lru_order_and_explicit_holders

KERNEL_TESTS=(
    bf16_to_f32_matches_half_for_all_65536_patterns
    dot_f32_every_tier_within_bound
    degenerate_shapes
    bf16_length_mismatch_is_caught
    mxfp4_width_must_be_whole_groups
    mxfp4_single_columns_decode_exactly
)
step "k3-worker kernels (scalar tier, Tree Borrows)"
MIRIFLAGS="${MIRIFLAGS:-} -Zmiri-tree-borrows -Zmiri-deterministic-floats" \
    cargo +nightly miri test -p k3-worker --test worker_suite -- "${KERNEL_TESTS[@]}"

echo "miri: all selected tests passed in $((SECONDS - start)) s"
