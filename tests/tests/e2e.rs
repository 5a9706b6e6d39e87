//! The end-to-end tests (the real k3 binaries, run as a user would) in one test binary: one link
//! and one copy of what they share, instead of one binary per file (scripts/test.sh's build
//! time). Each file is a module; run one with `cargo test -p k3-tests --test e2e FILE::`.

mod batch_e2e;
mod checkpoint_trust;
mod coded_trunk;
mod f32_router;
mod hostile;
mod loading;
mod lying_store;
mod memory;
mod pack_interrupt;
mod quant_trunk;
mod serve_channel;
mod sessions;
mod shared_ring;
mod spec_e2e;
mod state_trust;
mod store;
mod trunk_bound;
mod trunk_trust;
mod usage;
